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


def test_the_int8_estimate_of_the_bundled_model_is_what_it_holds():
    """Q4_1 and Q8_0 (and Q4_0, kept as Q4_1) multiply in their nibble and 8-bit layouts without an
    offset panel of their own, so the int8 mode holds what the estimate says (the memory check and
    `chatloom capacity` count it)."""
    import torch

    from chatloom.models.kernels import load_kernels
    from chatloom.models.loader import gguf_layout
    from chatloom.models.packed_linear import int8_matmul_supported
    from chatloom.models.registry import DEFAULT_MODEL, smollm2_path

    if not int8_matmul_supported(load_kernels()):
        pytest.skip("no int8 kernels on this CPU")
    reader = open_gguf(smollm2_path())
    keeps, int8, super_blocks = gguf_layout(reader, torch.float32, True, False)
    assert keeps and int8
    estimate = gguf_weight_bytes(reader.tensors, 4, keeps, super_blocks, int8_activations=int8)
    model, held, seen = load_model(DEFAULT_MODEL, "fp32", int8_matmul=True).model, 0, set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is not None and "rope" not in name and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            held += t.numel() * t.element_size()
    assert abs(estimate - held) < 0.02 * held
