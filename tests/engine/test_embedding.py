"""Embeddings through the prefill path: pooled, normalized, batch-independent, and no KV kept."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from chatloom.engine import EngineConfig, InvalidRequest, LLMEngine, SamplingParams
from chatloom.engine.async_engine import AsyncEngine
from chatloom.models.attention import AttentionBatch, PrefillSegment


def _prompts(vocab: int, n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


def _reference(loaded, ids: list[int], pooling: str) -> torch.Tensor:
    """The model's own forward over the whole prompt, no cache, pooled by hand."""
    n = len(ids)
    attn = AttentionBatch(num_decode=0, block_size=16)
    attn.prefills.append(PrefillSegment(0, n, n, None))
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(n), attn, None).double()
    vec = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vec, dim=0)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_match_a_plain_forward_and_are_unit_vectors(tiny_model, pooling):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=32))
    prompts = _prompts(tiny_model.config.vocab_size, 5)
    vectors = engine.embed(prompts, pooling)
    assert len(vectors) == 5
    for ids, vec in zip(prompts, vectors):
        v = torch.tensor(vec, dtype=torch.float64)
        assert v.shape == (tiny_model.config.hidden_size,)
        assert abs(v.norm().item() - 1.0) < 1e-5
        assert torch.allclose(v, _reference(tiny_model, ids, pooling), atol=1e-5)
    # Nothing kept: every block is free again and none was published in the prefix cache.
    assert engine.kv_cache_manager.num_free_blocks == 64
    assert engine.kv_cache_manager.pool.usage == 0


def test_batched_equals_one_by_one_and_chunking_does_not_matter(tiny_model):
    prompts = _prompts(tiny_model.config.vocab_size, 6, seed=11)
    small_steps = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=7))
    batched = small_steps.embed(prompts)
    one_engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=512))
    single = [one_engine.embed([p])[0] for p in prompts]
    for a, b in zip(batched, single):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
    assert small_steps.kv_cache_manager.num_free_blocks == 64


def test_pooling_modes_differ(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=32))
    p = _prompts(tiny_model.config.vocab_size, 1)[0]
    assert not torch.allclose(torch.tensor(engine.embed([p], "mean")[0]), torch.tensor(engine.embed([p], "last")[0]))


def test_bad_inputs_are_refused_before_anything_runs(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=8, block_size=16))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.embed([[]])
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.embed([[tiny_model.config.vocab_size + 5]])
    with pytest.raises(InvalidRequest, match="at most 128"):
        engine.embed([[1] * 129])
    with pytest.raises(InvalidRequest, match="pooling"):
        engine.embed([[1, 2]], "max")
    assert engine.kv_cache_manager.num_free_blocks == 8


def test_async_embeddings_run_between_generation_steps(tiny_model):
    async def main():
        engine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=4,
                                                                max_num_batched_tokens=16)))
        try:
            vocab = tiny_model.config.vocab_size
            gen = asyncio.create_task(engine.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True)))
            prompts = _prompts(vocab, 4, seed=3)
            vectors = await engine.embed(prompts)
            out = await gen
            assert len(out.token_ids) == 40
            offline = LLMEngine(tiny_model, EngineConfig(num_blocks=64)).embed(prompts)
            for a, b in zip(vectors, offline):
                assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
            with pytest.raises(InvalidRequest, match="empty"):
                await engine.embed([[1], []])
            assert engine.snapshot().kv_cache_free_blocks == 64
            assert not engine.engine.embedder.jobs
        finally:
            engine.shutdown()

    asyncio.run(main())
