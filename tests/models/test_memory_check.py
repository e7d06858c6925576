"""A model that will not fit is refused before loading, with one line naming the sizes."""
from __future__ import annotations

import pytest

from chatloom.models import ModelError, load_model
from chatloom.models.memory_check import available_memory_bytes, check_fits, gguf_weight_bytes
from chatloom.models.gguf_loader import open_gguf

import tiny_checkpoints as tc


def test_check_fits_names_the_sizes():
    check_fits("model x", 3 * 2**30, 2**30, available=5 * 2**30)  # fits: nothing raised
    with pytest.raises(ModelError) as err:
        check_fits("model x", 3 * 2**30, 2**30, available=2 * 2**30)
    msg = str(err.value)
    assert "\n" not in msg
    assert "weights 3.0 GiB + KV cache 1.0 GiB = 4.0 GiB, but only 2.0 GiB is available" in msg


def test_available_memory_is_read():
    avail = available_memory_bytes()
    assert avail is None or avail > 0


def test_load_refuses_a_kv_cache_that_cannot_fit(tmp_path):
    cfg = tc.hf_config("llama")
    folder = tc.write_hf_folder(tmp_path / "hf", cfg, tc.random_weights(cfg))
    with pytest.raises(ModelError, match="does not fit in memory: weights .* \\+ KV cache 931322.6 GiB"):
        load_model(str(folder), "fp32", kv_cache_bytes=lambda c: 10**15)
    load_model(str(folder), "fp32", kv_cache_bytes=1024)  # a small one loads


def test_quantized_gguf_is_counted_at_its_kept_size(tmp_path):
    cfg = tc.hf_config("llama", hidden_size=256, intermediate_size=256, head_dim=64)
    path = tmp_path / "kq.gguf"
    tc.write_kquant_gguf(path, cfg)
    reader = open_gguf(path)
    kept, floats = gguf_weight_bytes(reader.tensors, 4, True), gguf_weight_bytes(reader.tensors, 4, False)
    assert kept < floats / 2.5  # 4-8 bit panels instead of float32 matrices


def test_engine_refuses_a_pool_larger_than_memory(tiny_model_fp32, monkeypatch):
    from chatloom.engine import EngineConfig, LLMEngine
    import chatloom.models.memory_check as mc

    monkeypatch.setattr(mc, "available_memory_bytes", lambda: 2**20)
    with pytest.raises(ModelError, match="KV cache of 100000 blocks does not fit in memory"):
        LLMEngine(tiny_model_fp32, EngineConfig(num_blocks=100000))
