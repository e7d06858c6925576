"""The C++ float32 kernels (packed matmul, fused norm/activation/rotary) against PyTorch."""
from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import chatloom.models.llama as llama
from chatloom.models.kernels import load_kernels
from chatloom.models.packed_linear import (PackedLinear, QuantizedLinear, QuantizedWeight, pack_linears,
                                           from_float_kernel_layout, pack_quantized, pack_weight,
                                           to_float_kernel_layout,
                                           unpack_weight)
from chatloom.models.registry import tiny_random_config
from chatloom.models.weights import random_model

import tiny_checkpoints as tc

kernels = load_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels unavailable")


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 97, 200])
@pytest.mark.parametrize("n,k", [(17, 8), (96, 576), (130, 100)])
def test_packed_linear_matches_float64_reference(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w, x, b = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    packed = pack_weight(w)
    assert packed.shape == (-(-n // 16), k, 16)
    ref = x.double() @ w.double().t()
    torch.testing.assert_close(kernels.packed_linear(x, packed, n).double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.packed_linear(x, packed, n, b).double(), ref + b.double(),
                               rtol=1e-5, atol=1e-4)


def test_packed_linear_row_does_not_depend_on_the_batch():
    """Each output row is one FMA chain in a fixed order: the same bits alone or batched."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(200, 576, generator=gen), torch.randn(40, 576, generator=gen)
    packed = pack_weight(w)
    full = kernels.packed_linear(x, packed, 200)
    for i in (0, 5, 6, 17, 39):
        assert torch.equal(kernels.packed_linear(x[i:i + 1], packed, 200)[0], full[i])
        assert torch.equal(kernels.packed_linear(x[i:i + 7], packed, 200)[0], full[i])


def test_pack_roundtrip_and_packed_linear_module():
    lin = torch.nn.Linear(40, 33)
    packed = PackedLinear.from_linear(lin, kernels)
    assert torch.equal(unpack_weight(pack_weight(lin.weight), 33), lin.weight)
    assert torch.equal(packed.weight, lin.weight)
    x = torch.randn(3, 40)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)


def test_packed_linear_rejects_bad_shapes():
    packed = pack_weight(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="inner dimensions differ"):
        kernels.packed_linear(torch.randn(2, 9), packed, 20)
    with pytest.raises(RuntimeError, match="out_features"):
        kernels.packed_linear(torch.randn(2, 8), packed, 40)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.packed_linear(torch.randn(2, 8, dtype=torch.float64), packed, 20)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_norms_and_activation_match_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, 96, generator=gen) for _ in range(2))
    w = torch.randn(96, generator=gen)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (96,), w, 1e-5))
    res_ref = res + x
    out = kernels.add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(res, res_ref)  # the residual stream was updated in place
    torch.testing.assert_close(out, F.rms_norm(res_ref, (96,), w, 1e-5))
    gate_up = torch.randn(rows, 2 * 48, generator=gen) * 4
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), F.silu(gate_up[:, :48]) * gate_up[:, 48:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_matches_torch_on_views_of_fused_qkv(interleaved, monkeypatch):
    cfg = tiny_random_config()
    cfg.rope_interleaved = interleaved
    rope = llama.RotaryEmbedding(cfg)
    hq, hk, d = 4, 2, cfg.head_dim
    qkv = torch.randn(5, (hq + 2 * hk) * d)
    q, k, _ = qkv.split((hq * d, hk * d, hk * d), dim=1)
    q, k = q.view(5, hq, d), k.view(5, hk, d)
    positions = torch.tensor([0, 1, 7, 3, 30])
    got = kernels.rotary(q, k, positions, rope.cos, rope.sin, interleaved)
    with monkeypatch.context() as m:
        m.setattr(llama, "fused_kernels", lambda x: None)  # the PyTorch path
        want = rope(positions, q, k)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="position out of range"):
        kernels.rotary(q, k, torch.tensor([0, 1, 2, 3, 10 ** 6]), rope.cos, rope.sin, interleaved)


def test_kernel_model_matches_pytorch_model(monkeypatch):
    """The float32 model with packed weights and fused ops gives the PyTorch path's logits."""
    cfg = tiny_random_config()
    plain = random_model(cfg, torch.float64).float()  # float64 build: nn.Linear left as is
    assert isinstance(plain.lm_head, torch.nn.Linear)
    fast = copy.deepcopy(plain)
    assert pack_linears(fast)
    assert isinstance(fast.lm_head, PackedLinear) and isinstance(fast.layers[0].mlp.down_proj, PackedLinear)
    seqs = [list(range(3, 40)), list(range(50, 58))]
    got = fast.dense_logits(seqs)
    monkeypatch.setattr(llama, "fused_kernels", lambda x: None)
    want = plain.dense_logits(seqs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_float64_models_are_left_unpacked():
    model = random_model(tiny_random_config(), torch.float64)
    assert not pack_linears(model)
    assert isinstance(model.lm_head, torch.nn.Linear)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_linear_is_bit_identical_to_dequantized_float32(kind):
    """Weights kept 4/8-bit and expanded in the kernel give exactly what dequantizing with
    gguf at load time and running the float32 kernel gives (fused parts, odd row counts)."""
    from gguf import GGMLQuantizationType, quants

    parts = [QuantizedWeight(kind, tc.random_blocks(kind, rows, 96, rows), rows, 96) for rows in (20, 13)]
    dense = torch.cat([torch.from_numpy(quants.dequantize(p.raw, GGMLQuantizationType[kind]).astype(np.float32))
                       for p in parts])
    layer = QuantizedLinear(*pack_quantized(parts), 33, None, kernels)
    assert torch.equal(layer.weight, dense)
    codes, scales = layer.codes, layer.scales  # the float kernel's layout (to_float_kernel_layout)
    bias = torch.randn(33)
    for rows in (1, 4, 6, 9, 13):  # up to 12 rows expand weights in registers, more use a scratch panel
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(kernels.quantized_linear(x, codes, scales, 33, bias),
                           kernels.packed_linear(x, pack_weight(dense), 33, bias))
        torch.testing.assert_close(layer(x), x @ dense.t(), rtol=1e-5, atol=1e-5)


def _nine_panels(kind: str, isa: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused layer of 100 + 41 outputs over 128 inputs (9 panels, the last partly used): its
    packed codes and scales, and the weight as gguf dequantizes it. Skips where `isa` is missing."""
    from gguf import GGMLQuantizationType, quants

    if isa != "auto" and isa not in kernels.float_linear_isas():
        pytest.skip(f"this CPU has no {isa} path")
    parts = [QuantizedWeight(kind, tc.random_blocks(kind, rows, 128, rows), rows, 128) for rows in (100, 41)]
    dense = torch.cat([torch.from_numpy(quants.dequantize(p.raw, GGMLQuantizationType[kind]).astype(np.float32))
                       for p in parts])
    codes, scales = to_float_kernel_layout(*pack_quantized(parts))
    return codes, scales, dense


def _assert_each_row_keeps_its_bits(kind: str, isa: str, row_counts: Sequence[int], seed: int) -> None:
    """For each batch size in row_counts, quantized_linear over _nine_panels gives every row the bits it
    gets alone and the bits of the float32 kernel on the dequantized weight."""
    codes, scales, dense = _nine_panels(kind, isa)
    packed = pack_weight(dense)
    bias = torch.randn(141)
    x = torch.randn(max(row_counts), 128, generator=torch.Generator().manual_seed(seed))
    alone = [kernels.quantized_linear(x[i:i + 1], codes, scales, 141, bias, isa) for i in range(len(x))]
    for rows in row_counts:
        batch = kernels.quantized_linear(x[:rows], codes, scales, 141, bias, isa)
        assert torch.equal(batch, kernels.packed_linear(x[:rows], packed, 141, bias)), rows
        for i in range(rows):
            assert torch.equal(batch[i], alone[i][0]), (rows, i)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("isa", ["auto", "avx2", "avx512"])
def test_no_rows_give_an_empty_output(kind, isa):
    """A batch of no rows (the last layer of a step whose chunks give no logits) gets [0, out]; the
    few-rows path used to divide by the row count and kill the process."""
    codes, scales, dense = _nine_panels(kind, isa)
    x = torch.empty(0, 128)
    assert kernels.quantized_linear(x, codes, scales, 141, torch.randn(141), isa).shape == (0, 141)
    assert kernels.packed_linear(x, pack_weight(dense), 141, None).shape == (0, 141)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("isa", ["auto", "avx2", "avx512"])
def test_a_single_row_runs_several_panels_at_once_with_the_same_bits(kind, isa):
    """One input row (a decode step) takes its own kernel, four panels at a time: 141 outputs
    are groups of 4, 4 and 1 panels, the last one partly used. Every output must be the bits of
    the float32 kernel on the dequantized weight, and of the same row inside a larger batch."""
    codes, scales, dense = _nine_panels(kind, isa)
    bias = torch.randn(141)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(7))
    batch = kernels.quantized_linear(x, codes, scales, 141, bias, isa)
    for i in range(5):
        one = kernels.quantized_linear(x[i:i + 1], codes, scales, 141, bias, isa)
        assert torch.equal(one, kernels.packed_linear(x[i:i + 1], pack_weight(dense), 141, bias))
        assert torch.equal(one[0], batch[i])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("isa", ["auto", "avx2", "avx512"])
def test_a_few_rows_run_several_panels_at_once_with_the_same_bits(kind, isa):
    """2-12 rows (a small batch, or proposed tokens being verified) run each tile of rows against
    several panels at once: 141 outputs are 9 panels, groups of 4, 4 and 1, with sub-groups of
    4, 3, 2 and 1 depending on the rows. Every row must get the bits it gets alone and the bits
    of the float32 kernel on the dequantized weight."""
    _assert_each_row_keeps_its_bits(kind, isa, range(2, 13), seed=11)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("isa", ["auto", "avx2", "avx512"])
def test_many_rows_give_each_row_its_own_bits_whatever_the_last_tile(kind, isa):
    """13 rows and more take the scratch-panel path in tiles of at most 6 rows, split evenly (13 rows
    as 5 + 4 + 4, 32 as 6 + 6 + 5 + 5 + 5 + 5; each size its own kernel instantiation), in blocks of 96
    rows (97: a block, then one row alone), against panel pairs and the odd ninth panel alone. Every
    row must get the bits it gets alone and the float32 kernel's on the dequantized weight."""
    _assert_each_row_keeps_its_bits(kind, isa, [*range(13, 19), 25, 32, 97], seed=13)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K"])
def test_float_kernel_layout_round_trips_and_keeps_the_bits(kind):
    """to_float_kernel_layout keeps every value: 4-bit codes as words of 8 depths, scales in float16
    only where each is exactly one (GGUF's Q4_1 and Q8_0 store them so; Q4_K's products need
    float32). The kernel gives the same bits from either scale dtype, on every path and row count."""
    parts = [QuantizedWeight(kind, tc.random_blocks(kind, rows, 256, rows), rows, 256) for rows in (20, 13)]
    codes, scales = pack_quantized(parts)
    fast_codes, fast_scales = to_float_kernel_layout(codes, scales)
    assert fast_scales.dtype == (torch.float32 if kind == "Q4_K" else torch.float16)
    back_codes, back_scales = from_float_kernel_layout(fast_codes, fast_scales)
    assert torch.equal(back_codes, codes)
    same_bits = dict(rtol=0, atol=0, equal_nan=True)  # random K-quant blocks hold some inf * 0 scales
    torch.testing.assert_close(back_scales, scales, **same_bits)
    if codes.shape[2] == 8:  # depth 8g + t of feature j is nibble t of word j in group g
        words = fast_codes.view(torch.int32).view(codes.shape[0], -1, 16)
        k, j = 13, 11
        assert (words[1, k // 8, j] >> (4 * (k % 8))) & 15 == (codes[1, k, j % 8] >> (4 * (j // 8))) & 15
    for isa in ["auto"] + kernels.float_linear_isas():
        for rows in (1, 5, 13):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
            torch.testing.assert_close(kernels.quantized_linear(x, fast_codes, fast_scales, 33, None, isa),
                                       kernels.quantized_linear(x, fast_codes, fast_scales.float(), 33, None, isa),
                                       **same_bits)


def test_pack_linears_uses_quantized_weights_only_where_they_fit():
    lin_q, lin_f = torch.nn.Linear(64, 20, bias=False), torch.nn.Linear(64, 20, bias=False)
    model = torch.nn.ModuleDict({"q": lin_q, "f": lin_f})
    good = [QuantizedWeight("Q8_0", tc.random_blocks("Q8_0", 20, 64, 0), 20, 64)]
    assert pack_linears(model, {"q": good, "f": [QuantizedWeight("Q8_0", good[0].raw, 20, 32)]})
    assert isinstance(model["q"], QuantizedLinear)
    assert isinstance(model["f"], PackedLinear)  # wrong shape: falls back to float32 panels
    assert torch.equal(model["f"].weight, lin_f.weight)


def test_bundled_model_keeps_its_gguf_quantization(smollm2):
    model = smollm2.model
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantizedLinear)
    assert model.layers[0].mlp.gate_up_proj.codes.shape[2] == 8  # Q4_1: two rows per byte
    assert isinstance(model.lm_head, QuantizedLinear)  # the tied Q8_0 embedding
    # The embedding is kept in its Q8_0 blocks too; its rows are the head's, bit for bit.
    every_row = torch.arange(model.config.vocab_size)
    assert torch.equal(model.lm_head.weight, model.embed_tokens(every_row))


def test_the_library_is_named_by_its_sources_and_the_cpu_it_was_built_for():
    from chatloom.models.kernels import cpu_signature, library_name

    cpu = cpu_signature()
    assert cpu  # the model and flags -march=native reads (or the platform's name)
    assert library_name(b"sources", cpu) == library_name(b"sources", cpu)
    assert library_name(b"sources", cpu) != library_name(b"sources", cpu + b" avx512_vp2intersect")
    assert library_name(b"sources", cpu) != library_name(b"other sources", cpu)


def test_a_build_lock_left_by_a_killed_build_does_not_hold_the_next_one(tmp_path, monkeypatch):
    """torch's build lock is a file its build removes at the end: a process killed mid-build leaves it.
    The next build finds no live builder (none holds the OS lock) and goes on instead of waiting forever;
    a live builder's OS lock makes the next one wait for it."""
    import fcntl
    import threading

    import torch.utils.cpp_extension as cpp_extension

    from chatloom.models import kernels

    (tmp_path / "lock").touch()  # what a killed build leaves
    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append((tmp_path / "lock").exists()) or "module")
    assert kernels._build("k", [], tmp_path) == "module" and built == [False]

    with open(tmp_path / "build.flock", "w") as held:  # a build in progress in another process
        fcntl.flock(held, fcntl.LOCK_EX)
        second = threading.Thread(target=kernels._build, args=("k", [], tmp_path))
        second.start()
        second.join(0.3)
        assert second.is_alive() and len(built) == 1  # waiting for the live builder
    second.join(10)
    assert not second.is_alive() and len(built) == 2
