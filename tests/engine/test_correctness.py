"""Greedy engine outputs must equal generating each prompt alone with no cache,
whatever the block size, token budget, pool size, prefix sharing or attention path.
(The real-model version of this check is tests/models/test_kv_cache_equivalence.py.)"""
from __future__ import annotations

import itertools
import random

import pytest

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams

MAX_TOKENS = 16


def make_prompts(vocab: int, shared_prefix: bool, n: int = 16) -> list[list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(vocab) for _ in range(48)]
    prompts = []
    for i in range(n):
        own = [rng.randrange(vocab) for _ in range(rng.randrange(2, 70))]
        prompts.append((shared[: rng.randrange(17, 48)] if shared_prefix and i % 4 else []) + own)
    return prompts


def reference(model, prompt: list[int], n: int) -> list[int]:
    """Recompute the whole sequence every token: no KV cache at all."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model.dense_logits([seq])[0][-1].argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def references(tiny_model):
    out = {}
    for shared in (False, True):
        prompts = make_prompts(tiny_model.config.vocab_size, shared)
        out[shared] = (prompts, [reference(tiny_model.model, p, MAX_TOKENS) for p in prompts])
    return out


COMBOS = list(itertools.product([1, 16, 32], ["chunked", "whole"], ["small_pool", "big_pool"], [False, True]))


@pytest.mark.parametrize("block_size,budget,pool,shared", COMBOS)
def test_greedy_matches_no_cache_reference(tiny_model, references, block_size, budget, pool, shared):
    prompts, expected = references[shared]
    pool_tokens = 192 if pool == "small_pool" else 8192
    config = EngineConfig(block_size=block_size, num_blocks=pool_tokens // block_size,
                          max_num_batched_tokens=13 if budget == "chunked" else 4096, max_num_seqs=16)
    engine = LLMEngine(tiny_model, config)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = engine.get_stats()
    if pool == "small_pool":
        assert stats["num_preemptions"] > 0, "the small pool should force preemptions"
    if shared and budget == "chunked" and block_size < 32:
        assert stats["prefix_cache_hits"] > 0, "shared prefixes should hit the prefix cache"
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


@pytest.mark.parametrize("block_size", [1, 16])
def test_pytorch_attention_path_matches_too(tiny_model, references, block_size):
    """The pure-PyTorch fallback (no compiled kernel) gives the same tokens."""
    prompts, expected = references[True]
    engine = LLMEngine(tiny_model, EngineConfig(block_size=block_size, num_blocks=192 // block_size,
                                                max_num_batched_tokens=13))
    engine.runner.kernels = None
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    assert [o.token_ids for o in outs] == expected

