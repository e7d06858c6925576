"""Float32 linear layers whose weights are packed once for chatloom's C++ matmul kernel.

The kernel (kernels/gemm.cpp) beats the BLAS GEMM on the shapes a decode step runs (a few
to a few dozen rows), and every output row is computed the same way whatever else is in
the batch. `pack_linears` swaps a model's `nn.Linear` layers for these after loading:
`PackedLinear` holds float32 panels; `QuantizedLinear` keeps a GGUF file's Q4_0, Q4_1
or Q8_0 weights at 4 or 8 bits and expands them inside the kernel, bit-identical to the
float32 dequantization but with a fraction of the memory traffic per decode step; with
int8 activations (opt-in) it multiplies those codes in integers instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import os

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from chatloom.models.kernels import load_kernels

PANEL = 16  # output features per panel; must match kPanel in gemm.cpp


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K, 16] with packed[p, k, j] = weight[16p + j, k] (zero rows pad N)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = F.pad(weight.detach(), (0, 0, 0, panels * PANEL - n))
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of pack_weight: [N, K]."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:out_features]


class KernelLinear(nn.Module):
    """A linear layer that runs through the C++ matmul: output [T, out_features], float32."""

    in_features: int
    out_features: int


class PackedLinear(KernelLinear):
    """y = x @ W^T + b for float32 x [T, in_features], through the packed-weight kernel."""

    def __init__(self, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, kernels) -> None:
        super().__init__()
        self.in_features = packed.shape[1]
        self.out_features = out_features
        self.register_buffer("packed", packed)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self._kernels = kernels

    @classmethod
    def from_linear(cls, layer: nn.Linear, kernels) -> "PackedLinear":
        return cls(pack_weight(layer.weight), layer.out_features, layer.bias, kernels)

    @property
    def weight(self) -> torch.Tensor:
        """The weight in nn.Linear's layout (a copy; for inspection, not for the hot path)."""
        return unpack_weight(self.packed, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.packed_linear(x, self.packed, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> bf16_linear's panels [ceil(N/16), K/2, 32] bfloat16 (rounded to nearest even):
    element 2j + t of pair-row kk is weight[16p + j, 2kk + t]."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"the bf16 matmul needs an even number of input features, got {k}")
    panels = pack_weight(weight.float())  # [P, K, 16]
    return panels.view(panels.shape[0], k // 2, 2, PANEL).transpose(2, 3).reshape(
        panels.shape[0], k // 2, 2 * PANEL).to(torch.bfloat16).contiguous()


def unpack_bf16(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of pack_bf16, as float32 [N, K] (the bf16-rounded weight)."""
    panels, pairs, _ = packed.shape
    w = packed.float().view(panels, pairs, PANEL, 2).transpose(2, 3).reshape(panels, 2 * pairs, PANEL)
    return unpack_weight(w, out_features)


class BF16Linear(KernelLinear):
    """y = x @ W^T + b with W kept in bfloat16 and x rounded to bfloat16 per row, summed in
    float32: AVX-512 BF16's vdpbf16ps where the CPU has it, portable C++ elsewhere. Half the
    weight bytes of float32, with about 3 significant digits per weight and activation."""

    def __init__(self, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, kernels) -> None:
        super().__init__()
        self.in_features = packed.shape[1] * 2
        self.out_features = out_features
        self.register_buffer("packed", packed)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._kernels = kernels

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernels) -> "BF16Linear":
        return cls(pack_bf16(weight), weight.shape[0], bias, kernels)

    @property
    def weight(self) -> torch.Tensor:
        return unpack_bf16(self.packed, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.bf16_linear(x, self.packed, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 weights"


def bf16_matmul_requested() -> bool:
    """CHATLOOM_BF16_MATMUL=1 asks for bfloat16 weights where no caller chose (the service)."""
    return os.environ.get("CHATLOOM_BF16_MATMUL", "0") not in ("", "0", "false", "no")


def bf16_matmul_supported(kernels) -> bool:
    """Whether the kernels have the bf16 matmul (its fast path needs AVX-512 BF16; see bf16_linear_isas)."""
    return kernels is not None and hasattr(kernels, "bf16_linear")


def uses_bf16_matmul(model: nn.Module) -> bool:
    return any(isinstance(m, BF16Linear) for m in model.modules())


QUANT_BLOCK = 32  # weights per GGUF quantization block along K
QUANTIZED_KINDS = ("Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True)
class QuantizedWeight:
    """A GGUF matrix [rows, cols] as stored in the file: raw blocks, [rows, cols / 32 * block bytes]."""

    kind: str
    raw: np.ndarray
    rows: int
    cols: int


def _codes_and_scales(w: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integer codes [rows, cols] and per-block d, m [rows, cols/32] with w = d * code + m,
    computed exactly as gguf's dequantizer does."""
    nb = w.cols // QUANT_BLOCK
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[w.kind]
    raw = np.ascontiguousarray(w.raw).reshape(w.rows, nb, block_bytes)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if w.kind == "Q8_0":
        codes = raw[..., 2:].copy().view(np.int8)
        return codes.reshape(w.rows, w.cols), d, np.zeros_like(d)
    start = 4 if w.kind == "Q4_1" else 2
    qs = raw[..., start:start + 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(w.rows, w.cols)
    if w.kind == "Q4_1":
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return codes, d, m
    return codes.astype(np.int8) - np.int8(8), d, np.zeros_like(d)  # Q4_0: d * (q - 8)


def to_int8_layout(codes: torch.Tensor) -> torch.Tensor:
    """Quantized panels -> int8_linear's layout, where each group of 4 depths of the panel's
    16 features is the operand of one integer multiply-add:
    4-bit [P, K, 8] -> [P, K/4, 32] (byte 4j + i: feature j at depth 4g + i, low nibble;
    feature j + 8, high nibble); 8-bit [P, K, 16] -> [P, K/4, 64] (byte 32h + 4j + i:
    feature 8h + j at depth 4g + i)."""
    panels, k, width = codes.shape
    if width == 8:
        return codes.view(panels, k // 4, 4, 8).transpose(2, 3).reshape(panels, k // 4, 32).contiguous()
    return codes.view(panels, k // 4, 4, 2, 8).permute(0, 1, 3, 4, 2).reshape(panels, k // 4, 64).contiguous()


def from_int8_layout(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of to_int8_layout."""
    panels, groups, width = codes.shape
    if width == 32:
        return codes.view(panels, groups, 8, 4).transpose(2, 3).reshape(panels, groups * 4, 8).contiguous()
    return codes.view(panels, groups, 2, 8, 4).permute(0, 1, 4, 2, 3).reshape(panels, groups * 4, 16).contiguous()


def int8_matmul_requested() -> bool:
    """CHATLOOM_INT8_MATMUL=1 asks for int8 activations where no caller chose (the service)."""
    return os.environ.get("CHATLOOM_INT8_MATMUL", "0") not in ("", "0", "false", "no")


def int8_matmul_supported(kernels) -> bool:
    """Whether the kernels have the int8 matmul (built for a CPU with AVX2 and FMA)."""
    return kernels is not None and hasattr(kernels, "int8_linear") and kernels.int8_linear_supported()


def q4_0_as_q4_1(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 panels (int8 codes q - 8 [P, K, 16], m = 0) as Q4_1 ones (4-bit q, m = -8 d): the
    same weights exactly, in the form the int8 kernel reads."""
    q = (codes.to(torch.int16) + 8).to(torch.uint8)
    nibbles = q[..., :8] | (q[..., 8:] << 4)
    scales = scales.clone()
    scales[:, :, 1, :] = -8 * scales[:, :, 0, :]
    return nibbles.contiguous(), scales


def uses_int8_matmul(model: nn.Module) -> bool:
    """Whether any layer of `model` multiplies with int8 activations."""
    return any(isinstance(m, QuantizedLinear) and m.int8_activations for m in model.modules())


def pack_quantized(parts: list[QuantizedWeight]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `parts` stacked (a fused QKV or gate/up), as the kernel's panels:
    codes [P, K, 8] uint8 (Q4_1: two rows per byte) or [P, K, 16] int8, and scales
    [P, K/32, 2, 16] float32 (d, then m)."""
    kind, cols = parts[0].kind, parts[0].cols
    decoded = [_codes_and_scales(p) for p in parts]
    codes = np.concatenate([c for c, _, _ in decoded])
    d = np.concatenate([x for _, x, _ in decoded])
    m = np.concatenate([x for _, _, x in decoded])
    rows = codes.shape[0]
    panels = -(-rows // PANEL)
    pad = panels * PANEL - rows
    codes = np.pad(codes, ((0, pad), (0, 0)))
    d, m = np.pad(d, ((0, pad), (0, 0))), np.pad(m, ((0, pad), (0, 0)))
    codes = codes.reshape(panels, PANEL, cols).transpose(0, 2, 1)  # [P, K, 16]
    if kind == "Q4_1":
        codes = (codes[..., :8] | (codes[..., 8:] << 4)).astype(np.uint8)
    scales = np.stack([d.reshape(panels, PANEL, -1), m.reshape(panels, PANEL, -1)], axis=1)  # [P, 2, 16, nb]
    scales = scales.transpose(0, 3, 1, 2)  # [P, nb, 2, 16]
    return torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(np.ascontiguousarray(scales))


class QuantizedLinear(KernelLinear):
    """y = x @ W^T + b with W kept as GGUF Q4_0/Q4_1/Q8_0 panels.

    By default the arithmetic is float32 on the exactly dequantized weights. With
    `int8_activations` (Q4_1, Q8_0, or Q4_0 through q4_0_as_q4_1), each row of x is
    quantized to int8 per block of 32 and multiplied in integers, as llama.cpp does: about
    twice the speed, at the cost of rounding the activations to 8 bits."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None, kernels, int8_activations: bool = False) -> None:
        super().__init__()
        self.in_features = codes.shape[1]
        self.out_features = out_features
        self.int8_activations = int8_activations
        if self.int8_activations:
            codes = to_int8_layout(codes)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self._kernels = kernels

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [N, K] (a copy; for inspection, not for the hot path)."""
        codes = from_int8_layout(self.codes) if self.int8_activations else self.codes
        if codes.shape[2] == 8:  # two 4-bit rows per byte
            codes = torch.cat([codes & 0x0F, codes >> 4], dim=2)
        c = codes.float().view(codes.shape[0], -1, QUANT_BLOCK, PANEL)  # [P, nb, 32, 16]
        w = c * self.scales[:, :, 0:1, :] + self.scales[:, :, 1:2, :]
        return unpack_weight(w.reshape(codes.shape[0], -1, PANEL), self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            return self._kernels.int8_linear(x, self.codes, self.scales, self.out_features, self.bias)
        return self._kernels.quantized_linear(x, self.codes, self.scales, self.out_features, self.bias)

    def extra_repr(self) -> str:
        kind = "4-bit" if self.codes.shape[2] in (8, 32) else "8-bit"
        int8 = ", int8 activations" if self.int8_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}{int8}"


def pack_linears(model: nn.Module, quantized: Mapping[str, list[QuantizedWeight]] | None = None,
                 int8_activations: bool | None = None, bf16_weights: bool | None = None) -> bool:
    """Replace every float32 nn.Linear in `model` by a PackedLinear, or by a QuantizedLinear
    where `quantized` gives the layer's weight as stored in a GGUF file (by module name;
    several parts for a fused layer, all of one kind). Returns False (and changes nothing)
    when the kernels are unavailable or the model is not float32. With `int8_activations`
    (default: `int8_matmul_requested()`), quantized layers multiply with int8 activations where
    the CPU allows it.

    With `bf16_weights` (default: `bf16_matmul_requested()`), every layer instead keeps its
    (dequantized) weight in bfloat16 and multiplies through bf16_linear; int8 activations win
    where both are asked for.

    A head tied to the embedding gets its own packed copy; the embedding keeps its table."""
    kernels = load_kernels()
    if kernels is None or not hasattr(kernels, "packed_linear"):
        return False
    quantized = quantized or {}
    if int8_activations is None:
        int8_activations = int8_matmul_requested()
    int8_activations = int8_activations and int8_matmul_supported(kernels)
    if bf16_weights is None:
        bf16_weights = bf16_matmul_requested()
    bf16_weights = bf16_weights and not int8_activations and bf16_matmul_supported(kernels)
    linears = [(parent, f"{prefix}.{name}" if prefix else name, name, child)
               for prefix, parent in model.named_modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    if not linears or any(child.weight.dtype != torch.float32 for *_, child in linears):
        return False
    for parent, path, name, child in linears:
        parts = quantized.get(path)
        if bf16_weights and child.in_features % 2 == 0:
            layer = BF16Linear.from_weight(child.weight, child.bias, kernels)
        elif parts and _quantizable(parts, child):
            codes, scales = pack_quantized(parts)
            if int8_activations and parts[0].kind == "Q4_0":
                codes, scales = q4_0_as_q4_1(codes, scales)
            layer = QuantizedLinear(codes, scales, child.out_features, child.bias, kernels, int8_activations)
        else:
            layer = PackedLinear.from_linear(child, kernels)
        setattr(parent, name, layer)
    return True


def _quantizable(parts: list[QuantizedWeight], layer: nn.Linear) -> bool:
    kinds = {p.kind for p in parts}
    return (len(kinds) == 1 and kinds <= set(QUANTIZED_KINDS) and layer.in_features % QUANT_BLOCK == 0
            and all(p.cols == layer.in_features for p in parts)
            and sum(p.rows for p in parts) == layer.out_features)
