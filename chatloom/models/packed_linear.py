"""Float32 linear layers whose weights are packed once for chatloom's C++ matmul kernel.

The kernel (kernels/gemm.cpp) beats the BLAS GEMM on the shapes a decode step runs (a few
to a few dozen rows), and every output row is computed the same way whatever else is in
the batch. `pack_linears` swaps a model's `nn.Linear` layers for these after loading:
`PackedLinear` holds float32 panels; `QuantizedLinear` keeps a GGUF file's Q4_0, Q4_1
or Q8_0 weights at 4 or 8 bits and expands them inside the kernel, bit-identical to the
float32 dequantization but with a fraction of the memory traffic per decode step; with
int8 activations (opt-in) it multiplies those codes in integers instead. `KQuantLinear`
keeps Q4_K and Q6_K layers in their super-blocks (kquant_panels.py), the exact mode's
layout for them where the CPU has AVX-512, and with int8 activations where it has AVX-512 VNNI.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Mapping

import torch
from torch import nn
import torch.nn.functional as F

from chatloom.models.kernels import load_kernels
from chatloom.models.kquant_panels import INT8_KINDS, kquant_panels_fit, pack_kquant_panels, unpack_kquant_panels
# The GGUF layouts live in quant_layout.py; these names are part of this module's interface too.
from chatloom.models.quant_layout import (GROUP, PANEL, QUANT_BLOCK, QUANTIZED_KINDS,
                                          QuantizedWeight, from_float_kernel_layout, from_int8_layout,
                                          pack_quantized, q4_0_as_q4_1, quantized_layout, to_float_kernel_layout,
                                          to_int8_layout)

if TYPE_CHECKING:
    from chatloom.models.panel_cache import PanelCache


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

    def native(self):
        """This layer as the C++ decoder stack holds it (kernels.NativeLinear, sharing the
        weights), or None when the stack cannot run it."""
        return None


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

    def native(self):
        return _native(self._kernels, NATIVE_PACKED, self.packed, None, self.bias, None, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# Which kernel a NativeLinear calls (NativeLinear::Kind in kernels/decode_stack.h).
NATIVE_PACKED, NATIVE_QUANTIZED, NATIVE_INT8, NATIVE_GROUPED, NATIVE_GROUPED_INT8, NATIVE_BF16, NATIVE_KQUANT = range(7)


def _native(kernels, kind: int, weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None,
            m_panels: torch.Tensor | None, out_features: int):
    if not hasattr(kernels, "NativeLinear"):
        return None
    return kernels.NativeLinear(kind, weight, scales, bias, m_panels, out_features)


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

    def native(self):
        return _native(self._kernels, NATIVE_BF16, self.packed, None, self.bias, None, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 weights"


def bf16_matmul_supported(kernels) -> bool:
    """Whether the kernels have the bf16 matmul (its fast path needs AVX-512 BF16; see bf16_linear_isas)."""
    return kernels is not None and hasattr(kernels, "bf16_linear")


def uses_bf16_matmul(model: nn.Module) -> bool:
    return any(isinstance(m, BF16Linear) for m in model.modules())


def int8_matmul_supported(kernels) -> bool:
    """Whether the kernels have the int8 matmul (built for a CPU with AVX2 and FMA)."""
    return kernels is not None and hasattr(kernels, "int8_linear") and kernels.int8_linear_supported()


def uses_int8_matmul(model: nn.Module) -> bool:
    """Whether any layer of `model` multiplies with int8 activations."""
    return any(isinstance(m, (QuantizedLinear, KQuantLinear)) and m.int8_activations for m in model.modules())


class QuantizedLinear(KernelLinear):
    """y = x @ W^T + b with W kept as GGUF-quantized panels (see quantized_layout).

    By default the arithmetic is float32 on the exactly dequantized weights. With
    `int8_activations` (nibbles and int8 layouts; Q4_0 through q4_0_as_q4_1), each row of x
    is quantized to int8 per block of 32 and multiplied in integers, as llama.cpp does: about
    twice the speed, at the cost of rounding the activations to 8 bits. The int8 kernel's
    8-bit path has no m term, so a Q5_K layer adds it here: (block sums of x) @ m^T, a
    float32 matmul 32 times smaller than the layer's. The grouped layout (Q6_K, mixed kinds)
    has its own int8 kernel, quantizing x per 16 (kquant.cpp)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None, kernels, int8_activations: bool = False) -> None:
        super().__init__()
        self.in_features = codes.shape[1]
        self.out_features = out_features
        self.group = self.in_features // scales.shape[1]
        self.int8_activations = int8_activations and (self.group == QUANT_BLOCK or hasattr(kernels, "grouped_int8_linear"))
        m_panels = None
        if (self.int8_activations and self.group == QUANT_BLOCK and codes.shape[2] == PANEL
                and bool((scales[:, :, 1, :] != 0).any())):
            m = scales[:, :, 1, :].permute(0, 2, 1).reshape(-1, scales.shape[1])[:out_features]  # [N, K/32]
            m_panels = pack_weight(m)
        if self.int8_activations:
            codes = to_int8_layout(codes)
        elif self.group == QUANT_BLOCK:
            codes, scales = to_float_kernel_layout(codes, scales)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("m_panels", m_panels)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self._kernels = kernels

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [N, K] (a copy; for inspection, not for the hot path)."""
        codes, scales = self.codes, self.scales.float()
        if self.int8_activations:
            codes = from_int8_layout(codes)
        elif self.group == QUANT_BLOCK:
            codes, scales = from_float_kernel_layout(codes, scales)
        if codes.shape[2] == 8:  # two 4-bit rows per byte
            codes = torch.cat([codes & 0x0F, codes >> 4], dim=2)
        c = codes.float().view(codes.shape[0], -1, self.group, PANEL)  # [P, groups, group, 16]
        w = torch.addcmul(scales[:, :, 1:2, :], c, scales[:, :, 0:1, :])
        return unpack_weight(w.reshape(codes.shape[0], -1, PANEL), self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group == GROUP:
            kernel = self._kernels.grouped_int8_linear if self.int8_activations else self._kernels.grouped_quantized_linear
            return kernel(x, self.codes, self.scales, self.out_features, self.bias)
        if self.int8_activations:
            y = self._kernels.int8_linear(x, self.codes, self.scales, self.out_features, self.bias)
            if self.m_panels is not None:
                sums = x.reshape(x.shape[0], -1, QUANT_BLOCK).sum(dim=2)
                y += self._kernels.packed_linear(sums, self.m_panels, self.out_features)
            return y
        return self._kernels.quantized_linear(x, self.codes, self.scales, self.out_features, self.bias)

    def native(self):
        """The same choice of kernel as forward."""
        if self.group == GROUP:
            kind = NATIVE_GROUPED_INT8 if self.int8_activations else NATIVE_GROUPED
        else:
            kind = NATIVE_INT8 if self.int8_activations else NATIVE_QUANTIZED
        return _native(self._kernels, kind, self.codes, self.scales, self.bias,
                       self.m_panels if kind == NATIVE_INT8 else None, self.out_features)

    def greedy_screen(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For kernels.greedy_head_argmax (an exact head's argmax, screened with int8 activations):
        this layer's weights in int8_linear's layout, and each weight row's norm rounded up. None
        where it cannot screen this layer: int8 activations already, groups other than 32, a bias,
        or 8-bit codes with an m term (the int8 kernel's 8-bit path has none)."""
        if (self.int8_activations or self.group != QUANT_BLOCK or self.bias is not None
                or not int8_matmul_supported(self._kernels) or not hasattr(self._kernels, "greedy_head_argmax")):
            return None
        codes, scales = from_float_kernel_layout(self.codes, self.scales)
        if codes.shape[2] == PANEL and bool((scales[:, :, 1, :] != 0).any()):
            return None
        w = self.weight  # each weight as the kernels make it; its rows' norms in float64, a slice at a time
        norms = torch.cat([w[i:i + 4096].double().norm(dim=1) for i in range(0, w.shape[0], 4096)])
        norms = (norms * (1 + 1e-6)).float()
        norms = torch.nextafter(norms, torch.full_like(norms, float("inf")))  # rounded up
        return to_int8_layout(codes), scales.contiguous(), norms.contiguous()

    def extra_repr(self) -> str:
        kind = "4-bit" if self.codes.shape[2] in (8, 32) else "8-bit"
        group = f", a scale per {self.group}"
        int8 = ", int8 activations" if self.int8_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}{group}{int8}"


def kquant_matmul_supported(kernels) -> bool:
    """Whether the kernels have the super-block K-quant matmul and this CPU runs it (AVX-512)."""
    return kernels is not None and hasattr(kernels, "kquant_linear") and kernels.kquant_linear_supported()


def kquant_int8_supported(kernels) -> bool:
    """Whether this CPU runs the super-block K-quant matmul with int8 activations (AVX-512 VNNI)."""
    return kquant_matmul_supported(kernels) and hasattr(kernels, "kquant_int8_supported") \
        and kernels.kquant_int8_supported()


def kquant_int8_by_default(kernels) -> bool:
    """Whether K-quant files multiply with int8 activations unless told otherwise: where the CPU has the
    int8 super-block kernel (AVX-512 VNNI), and where it has no super-block kernel at all but the int8
    group-layout one (AVX2 without AVX-512: Zen 2 and 3, Intel's desktop cores), as there the int8
    layouts decode about 1.6x and prefill 1.9x as fast as the exact ones (docs/speed.md). An AVX-512
    CPU without VNNI keeps the exact super-blocks, which read fewer bytes."""
    return kquant_int8_supported(kernels) or (int8_matmul_supported(kernels) and not kquant_matmul_supported(kernels))


class KQuantLinear(KernelLinear):
    """y = x @ W^T + b with W kept as GGUF Q4_K / Q6_K super-blocks (kquant_panels.py), at about the
    file's bytes per weight: by default the exact mode's arithmetic (the bits of gguf's dequantizer
    followed by the float32 kernel); with `int8_activations` (panels packed for it) each row of x is
    quantized to int8 per 32 and multiplied with VNNI integer dot products (kquant_int8.cpp)."""

    def __init__(self, blob: torch.Tensor, offsets: torch.Tensor, kinds: torch.Tensor, in_features: int,
                 out_features: int, bias: torch.Tensor | None, kernels) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.int8_activations = bool(kinds.numel()) and int(kinds[0]) >= INT8_KINDS
        self.register_buffer("blob", blob)
        self.register_buffer("offsets", offsets)
        self.register_buffer("kinds", kinds)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self._kernels = kernels

    @classmethod
    def from_parts(cls, parts: list[QuantizedWeight], out_features: int, bias: torch.Tensor | None,
                   kernels, int8_activations: bool = False, cache: PanelCache | None = None) -> "KQuantLinear":
        return cls(*pack_kquant_panels(parts, int8_activations, cache), parts[0].cols, out_features, bias, kernels)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [N, K] (a copy; for inspection, not for the hot path)."""
        return unpack_kquant_panels(self.blob, self.offsets, self.kinds, self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.kquant_linear(x, self.blob, self.offsets, self.kinds, self.out_features, self.bias)

    def native(self):
        return _native(self._kernels, NATIVE_KQUANT, self.blob, self.offsets, self.bias, self.kinds,
                       self.out_features)

    def extra_repr(self) -> str:
        int8 = ", int8 activations" if self.int8_activations else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"K-quant super-blocks ({self.blob.numel() * 8 / (self.in_features * self.out_features):.2f} bits a weight)"
                f"{int8}")


def pack_linears(model: nn.Module, quantized: Mapping[str, list[QuantizedWeight]] | None = None,
                 int8_activations: bool = False, bf16_weights: bool = False,
                 panel_cache: PanelCache | None = None) -> bool:
    """Replace every float32 nn.Linear in `model` by a PackedLinear, or by a QuantizedLinear
    where `quantized` gives the layer's weight as stored in a GGUF file (by module name;
    several parts for a fused layer). Returns False (and changes nothing) when the kernels
    are unavailable or the model is not float32. With `int8_activations` (decided by the caller:
    the flag or environment is read once, in chatloom/model_args.py), quantized layers multiply
    with int8 activations where the CPU and their layout allow it.

    With `bf16_weights` (also decided by the caller), every layer instead keeps its
    (dequantized) weight in bfloat16 and multiplies through bf16_linear; int8 activations win
    where both are asked for.

    A head tied to the embedding gets its own packed copy; the embedding keeps its table. Super-block
    panels come from `panel_cache` where given (panel_cache.py)."""
    kernels = load_kernels()
    if not kernels_can_pack(kernels):
        return False
    quantized = quantized or {}
    int8_activations = int8_activations and int8_matmul_supported(kernels)
    bf16_weights = bf16_weights and not int8_activations and bf16_matmul_supported(kernels)
    kquant = kquant_matmul_supported(kernels)
    # Super-blocks with int8 activations read the file's bytes (4.6 and 6.6 bits a weight) where the
    # group-scale int8 layouts read 6 and 12.
    kquant_int8 = int8_activations and kquant_int8_supported(kernels)
    linears = [(parent, f"{prefix}.{name}" if prefix else name, name, child)
               for prefix, parent in model.named_modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    if not linears or any(child.weight.dtype != torch.float32 for *_, child in linears):
        return False

    def superblocks(parts: list[QuantizedWeight] | None, child: nn.Linear) -> bool:
        return bool(parts and (kquant_int8 or not int8_activations) and kquant_panels_fit(parts) and kquant
                    and quantizable(parts, child.in_features, child.out_features))

    def convert(path: str, child: nn.Linear) -> nn.Module:
        parts = quantized.get(path)
        if bf16_weights and child.in_features % 2 == 0:
            return BF16Linear.from_weight(child.weight, child.bias, kernels)
        if superblocks(parts, child):
            return KQuantLinear.from_parts(parts, child.out_features, child.bias, kernels, int8_activations,
                                           panel_cache)
        if parts and quantizable(parts, child.in_features, child.out_features):
            codes, scales = pack_quantized(parts)
            if int8_activations and parts[0].kind == "Q4_0" and quantized_layout(parts) == "int8":
                codes, scales = q4_0_as_q4_1(codes, scales)
            return QuantizedLinear(codes, scales, child.out_features, child.bias, kernels, int8_activations)
        return PackedLinear.from_linear(child, kernels)

    # Super-block layers are packed on as many threads as torch uses, largest first: their packer runs in
    # C++ without the GIL, and a thread the OS takes away holds up only its own layer, never the others
    # (as a split of one matrix across threads would). The other conversions call torch's own parallel
    # ops, so they stay on this thread.
    threaded = [item for item in linears
                if not (bf16_weights and item[3].in_features % 2 == 0) and superblocks(quantized.get(item[1]), item[3])]
    threaded.sort(key=lambda item: -item[3].in_features * item[3].out_features)
    workers = min(torch.get_num_threads(), len(threaded))
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="chatloom-pack") as pool:
            done = list(pool.map(lambda item: convert(item[1], item[3]), threaded))
        for (parent, _, name, _), layer in zip(threaded, done):
            setattr(parent, name, layer)
        threaded_ids = {id(item[3]) for item in threaded}
        linears = [item for item in linears if id(item[3]) not in threaded_ids]
    for parent, path, name, child in linears:
        setattr(parent, name, convert(path, child))
    return True


def kernels_can_pack(kernels) -> bool:
    """Whether the kernels hold every matmul pack_linears may use."""
    return kernels is not None and all(hasattr(kernels, n) for n in ("packed_linear", "grouped_quantized_linear"))


def quantizable(parts: list[QuantizedWeight], in_features: int, out_features: int) -> bool:
    """Whether a layer [out_features, in_features] can keep `parts` quantized."""
    return (all(p.kind in QUANTIZED_KINDS for p in parts) and in_features % QUANT_BLOCK == 0
            and all(p.cols == in_features for p in parts)
            and sum(p.rows for p in parts) == out_features)
