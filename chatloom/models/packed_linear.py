"""A float32 linear layer whose weight is packed once for chatloom's C++ matmul kernel.

The kernel (kernels/gemm.cpp) beats the BLAS GEMM on the shapes a decode step runs (a few
to a few dozen rows), and every output row is computed the same way whatever else is in
the batch. `pack_linears` swaps a model's `nn.Linear` layers for this one after loading.
"""
from __future__ import annotations

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


class PackedLinear(nn.Module):
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


def pack_linears(model: nn.Module) -> bool:
    """Replace every float32 nn.Linear in `model` by a PackedLinear. Returns False (and
    changes nothing) when the kernels are unavailable or the model is not float32.

    A head tied to the embedding gets its own packed copy; the embedding keeps its table."""
    kernels = load_kernels()
    if kernels is None or not hasattr(kernels, "packed_linear"):
        return False
    linears = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    if not linears or any(child.weight.dtype != torch.float32 for _, _, child in linears):
        return False
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear.from_linear(child, kernels))
    return True
