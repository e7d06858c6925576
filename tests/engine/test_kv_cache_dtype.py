"""A 16-bit KV cache (EngineConfig.kv_cache_dtype): half the bytes per token, values rounded as they
are stored, and a token's result independent of how its keys reached the pool."""
from __future__ import annotations

import pytest
import torch

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.config import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from chatloom.model_args import KV_CACHE_DTYPE_NAMES

PROMPTS = [list(range(10, 50)), [7] * 17, list(range(100, 133)), [42, 43]]


def _greedy(loaded, prompts, n=16, **config):
    engine = LLMEngine(loaded, EngineConfig(**config))
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return engine, [o.token_ids for o in outs]


@pytest.mark.parametrize("kv", ["fp16", "bf16"])
def test_the_pool_holds_16_bit_values_and_twice_the_tokens(tiny_model_fp32, kv):
    wide, _ = _greedy(tiny_model_fp32, PROMPTS[:1], kv_cache_gb=0.01)
    narrow, _ = _greedy(tiny_model_fp32, PROMPTS[:1], kv_cache_gb=0.01, kv_cache_dtype=kv)
    want = {"fp16": torch.float16, "bf16": torch.bfloat16}[kv]
    assert all(k.dtype == want and v.dtype == want for k, v in narrow.runner.kv_caches)
    assert abs(narrow.pool_tokens - 2 * wide.pool_tokens) <= narrow.kv_cache_manager.block_size  # whole blocks


@pytest.mark.parametrize("kv", ["fp16", "bf16"])
def test_chunking_and_prefix_reuse_do_not_change_the_tokens(tiny_model_fp32, kv):
    # Whole prompts at once, or in chunks of 8 mixed with decodes, or reusing cached blocks: the
    # queries see keys rounded the same way in every case, so the tokens agree.
    _, whole = _greedy(tiny_model_fp32, PROMPTS, num_blocks=64, kv_cache_dtype=kv)
    _, chunked = _greedy(tiny_model_fp32, PROMPTS, num_blocks=128, block_size=4, max_num_batched_tokens=8,
                         kv_cache_dtype=kv)
    assert chunked == whole
    engine = LLMEngine(tiny_model_fp32, EngineConfig(num_blocks=64, kv_cache_dtype=kv))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine.generate(PROMPTS[:1], params, use_tqdm=False)
    again = engine.generate(PROMPTS, params, use_tqdm=False)
    assert engine.get_stats()["prefix_cache_hits"] > 0
    assert [o.token_ids for o in again] == whole


@pytest.mark.parametrize("kv", ["fp16", "bf16"])
def test_the_kernel_and_the_pytorch_path_read_the_pool_alike(tiny_model_fp32, kv):
    # The same 16-bit pool read by the C++ kernel and by the plain PyTorch path (gather, widen, SDPA).
    from chatloom.models.kernels import load_kernels

    if load_kernels() is None:
        pytest.skip("C++ kernels unavailable")
    engine, tokens = _greedy(tiny_model_fp32, PROMPTS, num_blocks=64, kv_cache_dtype=kv)
    plain = LLMEngine(tiny_model_fp32, EngineConfig(num_blocks=64, kv_cache_dtype=kv))
    plain.runner.kernels = None
    outs = plain.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == tokens


def test_the_int8_mode_defaults_to_float16_and_exact_keeps_float32(smollm2):
    assert resolve_kv_cache_dtype("auto", torch.float32, int8_matmul=True) == torch.float16
    assert resolve_kv_cache_dtype("auto", torch.float32, int8_matmul=False) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, int8_matmul=False) == torch.bfloat16
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=8))
    assert engine.runner.kv_caches[0][0].dtype == torch.float32


def test_bad_choices_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        resolve_kv_cache_dtype("int4", torch.float32, False)
    with pytest.raises(ValueError, match="float64"):
        resolve_kv_cache_dtype("fp16", torch.float64, False)


def test_a_float16_pool_saturates_instead_of_storing_infinity():
    from chatloom.models.attention import as_stored

    x = torch.tensor([1e6, -7e4, 1.0, 65504.0])
    assert as_stored(x, torch.float16).tolist() == [65504.0, -65504.0, 1.0, 65504.0]


def test_the_service_setting_and_the_flags_reach_the_engine(tmp_path):
    from chatloom.settings import load_settings
    from chatloom.cli.main import build_parser

    toml = tmp_path / "s.toml"
    toml.write_text('[engine]\nkv_cache_dtype = "fp16"\n')
    assert EngineConfig.from_settings(load_settings(toml).engine).kv_cache_dtype == "fp16"
    toml.write_text('[engine]\nkv_cache_dtype = "int4"\n')
    with pytest.raises(ValueError, match="setting engine.kv_cache_dtype: input should be 'auto', 'fp32', 'bf16' or 'fp16', not 'int4'"):
        load_settings(toml)
    parser = build_parser()
    for command in (["serve"], ["replica"]):
        for choice in ("auto", *KV_CACHE_DTYPES):  # the flag offers what the engine takes
            assert parser.parse_args([*command, "--kv-cache-dtype", choice]).kv_cache_dtype == choice
        assert parser.parse_args([*command, "--kv-cache-dtype", "bf16"]).kv_cache_dtype == "bf16"
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--kv-cache-dtype", "int4"])
    # The torch-free names the parsers offer (serve, replica, bench attention) are the engine's dtypes.
    assert set(KV_CACHE_DTYPE_NAMES) == set(KV_CACHE_DTYPES)
