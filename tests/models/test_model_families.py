"""Every supported family and RoPE scaling, against transformers on the same random weights.

Each tiny checkpoint is written to disk in its family's own Hugging Face layout (and, for
llama3/linear/yarn RoPE and Qwen3, as a GGUF file too), loaded through load_model, and its
logits compared with transformers' implementation, on sequences longer than the original
context of the scaled RoPE and than the sliding windows. The engine's greedy outputs with
everything batched must equal generating each prompt alone without a cache.
"""
from __future__ import annotations

import random

import pytest
import torch

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models import load_model

import tiny_checkpoints as tc

pytest.importorskip("transformers")

LONG = 40  # tokens: past every original context below (16) and every window (6)


def _seqs(vocab: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 3) for _ in range(n)] for n in (LONG, 3, 23)]


ROPE = {
    "llama3": dict(max_position_embeddings=64, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "yarn": dict(max_position_embeddings=64, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "linear": dict(max_position_embeddings=16, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "dynamic": dict(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
}
FAMILIES = ["qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe"]


def _config(name: str) -> dict:
    return tc.hf_config("llama", **ROPE[name]) if name in ROPE else tc.hf_config(name)


@pytest.fixture(scope="module", params=list(ROPE) + FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(name, hf config, folder, transformers model)."""
    name = request.param
    cfg = _config(name)
    folder = tc.write_hf_folder(tmp_path_factory.mktemp(name) / "hf", cfg, tc.random_weights(cfg, seed=11))
    return name, cfg, folder, tc.transformers_model(folder)


@torch.inference_mode()
def _incremental_logits(model, seq: list[int]) -> torch.Tensor:
    """transformers feeding one token at a time through its cache (dynamic NTK's reference:
    each token rotated with the base for the length so far)."""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    for i, t in enumerate(seq):
        res = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[i]]))
        cache = res.past_key_values
        out.append(res.logits[0, -1].float())
    return torch.stack(out)


def _reference_logits(name: str, hf, seqs: list[list[int]]) -> list[torch.Tensor]:
    if name == "dynamic":
        return [_incremental_logits(hf, s) for s in seqs]
    return tc.transformers_logits(hf, seqs)


def _max_diff(ours, theirs) -> float:
    assert [o.shape for o in ours] == [t.shape for t in theirs]
    return max(float((o.float() - t).abs().max()) for o, t in zip(ours, theirs))


def test_hf_folder_matches_transformers(checkpoint):
    name, cfg, folder, hf = checkpoint
    loaded = load_model(str(folder), "fp32")
    mine = loaded.config
    assert mine.architecture == cfg["model_type"]
    if name in ROPE:
        assert mine.rope_scaling.type == name
        assert mine.max_position >= LONG
    seqs = _seqs(cfg["vocab_size"])
    assert _max_diff(loaded.model.dense_logits(seqs), _reference_logits(name, hf, seqs)) < 1e-3


def test_family_features_are_read(checkpoint):
    """The switches the parity test relies on are really on (else it could pass vacuously)."""
    name, _, folder, _ = checkpoint
    cfg = load_model(str(folder), "fp32").config
    expect = {
        "qwen3": dict(qk_norm=True), "phi3": dict(qk_norm=False),
        "gemma2": dict(sandwich_norms=True, hidden_act="gelu_tanh", attn_softcap=5.0, final_softcap=3.0,
                       layer_windows=[6, None], attention_scale=16 ** -0.5),
        "gemma3_text": dict(sandwich_norms=True, qk_norm=True, layer_windows=[6, None], rope_local_theta=100.0),
        "mixtral": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        "qwen2_moe": dict(num_experts=4, norm_topk_prob=False, shared_expert_intermediate_size=40,
                          moe_layers=[True, False]),
        "qwen3_moe": dict(num_experts=4, norm_topk_prob=True, qk_norm=True),
    }.get(name, {})
    for key, value in expect.items():
        assert getattr(cfg, key) == value, key


@pytest.mark.parametrize("name", ["llama3", "yarn", "linear"])
def test_gguf_rope_scaling_matches_transformers(name, tmp_path):
    cfg = _config(name)
    weights = tc.random_weights(cfg, seed=5)
    folder = tc.write_hf_folder(tmp_path / "hf", cfg, weights)
    path = tc.write_gguf(tmp_path / f"{name}.gguf", cfg, weights)
    loaded = load_model(str(path), "fp32")
    assert loaded.config.rope_scaling.type == name
    seqs = _seqs(cfg["vocab_size"])
    assert _max_diff(loaded.model.dense_logits(seqs), tc.transformers_logits(tc.transformers_model(folder), seqs)) < 1e-3


def test_gguf_qwen3_matches_transformers(tmp_path):
    cfg = tc.hf_config("qwen3")
    weights = tc.random_weights(cfg, seed=6)
    folder = tc.write_hf_folder(tmp_path / "hf", cfg, weights)
    loaded = load_model(str(tc.write_gguf(tmp_path / "qwen3.gguf", cfg, weights)), "fp32")
    assert loaded.config.qk_norm and not loaded.config.rope_interleaved
    seqs = _seqs(cfg["vocab_size"])
    assert _max_diff(loaded.model.dense_logits(seqs), tc.transformers_logits(tc.transformers_model(folder), seqs)) < 1e-3


def _alone(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model.dense_logits([seq])[0][-1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("name", ["llama3", "dynamic", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3"])
def test_engine_greedy_equals_each_prompt_alone(name, tmp_path):
    """Batched, chunked, preempted, prefix-shared decoding over windows, soft-caps, experts
    and scaled RoPE gives what each prompt gives alone without a cache (float64, so that the
    comparison is about the engine, not float rounding)."""
    cfg = _config(name)
    folder = tc.write_hf_folder(tmp_path / "hf", cfg, tc.random_weights(cfg, seed=9))
    loaded = load_model(str(folder), "fp64")
    rng = random.Random(3)
    shared = [rng.randrange(cfg["vocab_size"] - 3) for _ in range(20)]
    prompts = [(shared[: rng.randrange(5, 20)] if i % 2 else []) + [rng.randrange(cfg["vocab_size"] - 3)
                                                                   for _ in range(rng.randrange(2, 25))]
               for i in range(6)]
    expected = [_alone(loaded.model, p, 12) for p in prompts]
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=40, max_num_batched_tokens=7, max_num_seqs=6))
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected


def test_published_config_shapes_are_read():
    """Config keys as published checkpoints spell them (older and newer transformers)."""
    from chatloom.models.hf_config import config_from_hf

    llama31 = config_from_hf(tc.hf_config("llama", max_position_embeddings=131072, rope_theta=500000.0,
                                          rope_scaling={"factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192,
                                                        "rope_type": "llama3"}))
    assert (llama31.rope_scaling.type, llama31.max_position, llama31.rope_trained_max_position) == (
        "llama3", 131072, 131072)
    qwen_yarn = config_from_hf(tc.hf_config("qwen2", max_position_embeddings=32768, rope_scaling={
        "factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}))
    assert (qwen_yarn.rope_scaling.type, qwen_yarn.max_position) == ("yarn", 131072)
    gemma3 = config_from_hf({k: v for k, v in tc.hf_config("gemma3_text", num_hidden_layers=12).items()
                             if k != "layer_types"} | {"sliding_window_pattern": 6, "sliding_window": 512})
    assert gemma3.layer_windows == [512] * 5 + [None] + [512] * 5 + [None]
    gemma2 = config_from_hf(tc.hf_config("gemma2", num_hidden_layers=4, sliding_window=4096))
    assert gemma2.layer_windows == [4096, None, 4096, None]
