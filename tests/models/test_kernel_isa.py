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
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 100])
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
