"""The int8 matmul's instruction paths (AVX-512 VNNI, AVX2, scalar), each forced in turn:
every path this CPU has matches the integer reference and gives the same bits as the others.
Paths the CPU lacks are skipped, and asking for one is a clear error."""
from __future__ import annotations

import pytest
import torch

from chatloom.models.kernels import load_kernels

from test_int8_matmul import _int8_reference, _layer

kernels = load_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "int8_linear_isas"),
                                reason="C++ kernels unavailable")
PATHS = ["avx512_vnni", "avx2", "scalar"]


def _require(isa: str) -> None:
    if isa not in kernels.int8_linear_isas():
        pytest.skip(f"this CPU has no {isa} path")


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 12, 13, 14, 15, 16, 17, 100])  # every tile height of every path
def test_forced_path_matches_the_reference_and_the_scalar_bits(isa, kind, rows):
    _require(isa)
    layer, dense = _layer(kind, 45, 160, rows)  # 45 outputs: the last panel is partly used
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(10 + rows)) * 3
    bias = torch.randn(45)
    got = kernels.int8_linear(x, layer.codes, layer.scales, 45, bias, isa)
    torch.testing.assert_close(got.double(), _int8_reference(x, dense) + bias.double(), rtol=1e-5, atol=1e-4)
    # Exact integer sums and the same float steps in the same order: the very same bits.
    assert torch.equal(got, kernels.int8_linear(x, layer.codes, layer.scales, 45, bias, "scalar"))


def test_auto_picks_the_best_path_and_names_are_checked():
    available = kernels.int8_linear_isas()
    assert available[-1] == "scalar" and set(available) <= set(PATHS)
    assert kernels.int8_linear_isa("auto") in available
    assert kernels.int8_linear_isa("scalar") == "scalar"
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        kernels.int8_linear_isa("sse9")
    for isa in set(PATHS) - set(available):
        with pytest.raises(RuntimeError, match="not available"):
            kernels.int8_linear_isa(isa)


def test_peak_measurement_covers_what_the_cpu_has():
    kinds = kernels.peak_kinds()
    for kind in kinds:
        assert kernels.peak_gops(kind, 20000) > 0
    if "avx512_vnni" in kernels.int8_linear_isas():
        assert "int8_avx512_vnni" in kinds
    with pytest.raises(RuntimeError, match="unknown peak kind"):
        kernels.peak_gops("warp_drive", 10)


# -- the bf16 matmul ------------------------------------------------------------------------------

BF16_PATHS = ["avx512_bf16", "scalar"]


def _bf16_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Both operands rounded to bfloat16 (nearest even), the products summed in float64."""
    return x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().t()


@pytest.mark.parametrize("isa", BF16_PATHS)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 130])
def test_bf16_forced_path_matches_the_reference(isa, rows):
    from chatloom.models.packed_linear import pack_bf16

    if isa not in kernels.bf16_linear_isas():
        pytest.skip(f"this CPU has no {isa} path")
    gen = torch.Generator().manual_seed(rows)
    w, x, bias = torch.randn(37, 96, generator=gen), torch.randn(rows, 96, generator=gen), torch.randn(37)
    got = kernels.bf16_linear(x, pack_bf16(w), 37, bias, isa)
    torch.testing.assert_close(got.double(), _bf16_reference(x, w) + bias.double(), rtol=1e-4, atol=1e-4)
    # A row's result does not depend on the rest of the batch, nor on which tile of rows holds it.
    for i in range(rows):
        assert torch.equal(kernels.bf16_linear(x[i:i + 1], pack_bf16(w), 37, bias, isa)[0], got[i]), i


def test_bf16_packing_and_layers_of_a_model(tiny_model_fp32):
    from chatloom.models import load_model
    from chatloom.models.packed_linear import BF16Linear, pack_bf16, pack_linears, unpack_bf16, uses_bf16_matmul

    w = torch.randn(20, 64)
    assert torch.equal(unpack_bf16(pack_bf16(w), 20), w.to(torch.bfloat16).float())
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        kernels.bf16_linear(torch.randn(1, 64), pack_bf16(w), 20, None, "avx9")
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(64, 20)})
    assert pack_linears(model, bf16_weights=True) and isinstance(model["a"], BF16Linear)
    # The tiny model with bf16 weights stays close to its float32 self.
    fast = load_model("tiny-random", "fp32", bf16_matmul=True)
    assert uses_bf16_matmul(fast.model) and not uses_bf16_matmul(tiny_model_fp32.model)
    ids = list(range(3, 40))
    exact, approx = tiny_model_fp32.model.dense_logits([ids])[0], fast.model.dense_logits([ids])[0]
    assert (approx - exact).norm() / exact.norm() < 0.02


# -- the float32 matmuls (exact mode): AVX-512 must give the AVX2 path's bits --------------------

@pytest.mark.parametrize("rows", [1, 2, 4, 6, 7, 12, 13, 100])
def test_float_paths_give_the_same_bits(rows):
    from chatloom.models.packed_linear import pack_weight

    if "avx512" not in kernels.float_linear_isas():
        pytest.skip("this CPU has no avx512 path")
    gen = torch.Generator().manual_seed(rows)
    w, x, bias = torch.randn(45, 96, generator=gen), torch.randn(rows, 96, generator=gen), torch.randn(45)
    wide = kernels.packed_linear(x, pack_weight(w), 45, bias, "avx512")
    assert torch.equal(wide, kernels.packed_linear(x, pack_weight(w), 45, bias, "avx2"))
    torch.testing.assert_close(wide.double(), x.double() @ w.double().t() + bias.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 12, 13, 50, 100])
def test_quantized_float_paths_give_the_same_bits(kind, rows):

    if "avx512" not in kernels.float_linear_isas():
        pytest.skip("this CPU has no avx512 path")
    int8_layer, dense = _layer(kind, 45, 160, rows)
    from chatloom.models.packed_linear import from_int8_layout, to_float_kernel_layout
    codes, scales = to_float_kernel_layout(from_int8_layout(int8_layer.codes), int8_layer.scales)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    wide = kernels.quantized_linear(x, codes, scales, 45, None, "avx512")
    assert torch.equal(wide, kernels.quantized_linear(x, codes, scales, 45, None, "avx2"))
    torch.testing.assert_close(wide.double(), x.double() @ dense.double().t(), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        kernels.quantized_linear(x, codes, scales, 45, None, "neon")
