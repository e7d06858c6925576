"""Load-time conversions of GGUF blocks in C++ (kernels/weight_repack.cpp): the same float32 values
as gguf's dequantizer and the same panel bytes as the numpy packer, on one thread and on two, and
each weight read once while a model is built."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from chatloom.models import weight_repack
from chatloom.models.kernels import load_kernels
from chatloom.models.kquant_panels import SUPER_BYTES, pack_kquant_panels
from chatloom.models.quant_layout import QuantizedWeight
from chatloom.models.registry import tiny_random_config
from chatloom.models import weights

import tiny_checkpoints as tc

kernels = load_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels unavailable")


def _blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    if kind in ("Q4_0",):
        return tc.random_blocks(kind, rows, cols, seed)
    return tc.random_kquant_blocks(kind, rows, cols, seed)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", weight_repack.NATIVE_DEQUANT)
def test_dequantize_equals_gguf_bit_for_bit(kind, threads):
    raw = _blocks(kind, 37, 512, seed=len(kind))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = weight_repack.dequantize(raw, kind, (37, -1))
    finally:
        torch.set_num_threads(before)
    assert got is not None and got.dtype == torch.float32
    want = tc.dequantize(kind, raw)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # the bits, signed zeros too


def test_dequantize_reads_a_stacked_tensor_and_refuses_other_kinds():
    raw = _blocks("Q6_K", 12, 256, seed=3).reshape(3, 4, -1)  # three experts of four rows
    got = weight_repack.dequantize(raw, "Q6_K", (3, 4, -1))
    assert torch.equal(got.reshape(12, -1), tc.dequantize("Q6_K", raw.reshape(12, -1)))
    assert weight_repack.dequantize(raw, "Q3_K", (3, 4, -1)) is None
    with pytest.raises(RuntimeError, match="not whole"):
        kernels.dequantize_blocks(torch.zeros(2, 100, dtype=torch.uint8), "Q6_K")


def _numpy_pack(parts, monkeypatch, int8=False):
    with monkeypatch.context() as m:
        m.setattr(weight_repack, "load_kernels", lambda: None)
        return pack_kquant_panels(parts, int8)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kinds,sizes", [(["Q4_K"], [40]), (["Q6_K"], [33]),
                                         (["Q4_K", "Q4_K", "Q6_K"], [32, 16, 17]),
                                         (["Q6_K", "Q4_K"], [16, 5])])
def test_panels_equal_the_numpy_packer_byte_for_byte(kinds, sizes, threads, int8, monkeypatch):
    parts = [QuantizedWeight(k, tc.random_kquant_blocks(k, n, 512, 7 + i), n, 512)
             for i, (k, n) in enumerate(zip(kinds, sizes))]
    want = _numpy_pack(parts, monkeypatch, int8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = weight_repack.pack_panels(parts, SUPER_BYTES, int8)  # the C++ packer itself
    finally:
        torch.set_num_threads(before)
    assert got is not None
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_panels_of_read_only_file_memory(monkeypatch):
    raw = tc.random_kquant_blocks("Q4_K", 20, 256, 1)
    raw.flags.writeable = False  # as a read-only memory map hands them out
    parts = [QuantizedWeight("Q4_K", raw, 20, 256)]
    for g, w in zip(pack_kquant_panels(parts), _numpy_pack(parts, monkeypatch)):
        assert torch.equal(g, w)


def test_build_model_reads_each_weight_once(monkeypatch):
    """A GGUF getter dequantizes on every call: the builder must not ask twice for one weight."""
    calls: dict[str, int] = {}
    real_build = weights.build_model

    def counting_build(cfg, get, *args, **kwargs):
        def counted(name: str) -> torch.Tensor | None:
            t = get(name)
            if t is not None:
                calls[name] = calls.get(name, 0) + 1
            return t
        return real_build(cfg, counted, *args, **kwargs)

    monkeypatch.setattr(weights, "build_model", counting_build)
    weights.random_model(tiny_random_config(), torch.float32)
    assert "model.embed_tokens.weight" in calls
    assert max(calls.values()) == 1, {n: c for n, c in calls.items() if c > 1}


def test_build_model_computes_the_rope_tables_once(monkeypatch):
    """The constructor's tables are kept through to_empty, not computed again (1 s of CPU at 128k positions)."""
    from chatloom.models import llama
    from chatloom.models.rope import rope_tables

    calls = []
    monkeypatch.setattr(llama, "rope_tables", lambda *a: calls.append(a) or rope_tables(*a))
    cfg = tiny_random_config()
    model = weights.random_model(cfg, torch.float32)
    assert len(calls) == 1
    cos, sin = rope_tables(*calls[0])
    assert torch.equal(model.rope.cos, cos) and torch.equal(model.rope.sin, sin)
    assert all(r is model.rope for r in model.layer_ropes)
