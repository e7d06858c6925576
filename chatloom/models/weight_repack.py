"""Load-time conversions of GGUF blocks on the C++ kernels (kernels/weight_repack.cpp), multithreaded:
float32 expansion of the tensors a model keeps as floats, and the super-block panels of Q4_K / Q6_K
layers. Each returns None where the kernels are not built, and the caller takes the numpy path
(whose values and bytes these match exactly)."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from chatloom.models.kernels import load_kernels
from chatloom.models.quant_layout import PANEL, SUPER_BLOCK, QuantizedWeight

NATIVE_DEQUANT = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_PANEL_KINDS = {"Q4_K": 0, "Q6_K": 1}
_INT8_KINDS = 2  # added to a kind for the int8-activation kernel (kquant_panels.INT8_KINDS)


def as_bytes(raw: np.ndarray) -> torch.Tensor:
    """A uint8 [rows, bytes] tensor over `raw`'s memory (a view of the mapped file where it is
    contiguous: nothing is copied)."""
    arr = np.ascontiguousarray(raw)
    arr = arr.reshape(arr.shape[0] if arr.ndim > 1 else 1, -1)
    with warnings.catch_warnings():  # torch warns that the map is read-only: the kernels only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def file_span(raw: np.ndarray) -> tuple[str, int] | None:
    """(file name, byte offset) of `raw` where it is a contiguous view of a memory-mapped file, else None."""
    if not raw.flags.c_contiguous:
        return None
    base = raw.base
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is None or base.filename is None:
        return None
    start = raw.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    if start < 0 or start + raw.nbytes > base.nbytes:
        return None
    return base.filename, base.offset + start


def mapped_alone(raw: np.ndarray) -> np.ndarray | None:
    """The same bytes as `raw`, a view of a memory-mapped file, through a mapping of their own (read-only),
    or None where `raw` is not a contiguous view of a mapped file. Nothing is copied: a table kept this
    way costs no new memory, its pages are the file's in the page cache, and it keeps only its own part
    of the file mapped (the model file's mapping can go once loading is done)."""
    span = file_span(raw)
    if span is None:
        return None
    return np.memmap(span[0], dtype=raw.dtype, mode="r", offset=span[1], shape=raw.shape)


def dequantize(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """float32 weights of `shape` from their GGUF blocks `raw`, or None without the kernels."""
    kernels = load_kernels()
    if kernels is None or kind not in NATIVE_DEQUANT or not hasattr(kernels, "dequantize_blocks"):
        return None
    return kernels.dequantize_blocks(as_bytes(raw), kind).reshape(shape)


def pack_panels(parts: list[QuantizedWeight], super_bytes: dict[str, int], int8: bool = False,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """kquant_panels.pack_kquant_panels on the kernels: (blob, offsets, kinds), or None without them.
    `parts` must fit (kquant_panels_fit); with `int8`, the int8-activation kernel's kinds. The blob is
    written into `out` (uint8, of the blob's size) where given."""
    kernels = load_kernels()
    if kernels is None or not hasattr(kernels, "kquant_pack_panels"):
        return None
    nb = parts[0].cols // SUPER_BLOCK
    sizes = [super_bytes[p.kind] * nb * -(-p.rows // PANEL) for p in parts]
    blob = torch.empty(sum(sizes), dtype=torch.uint8) if out is None else out
    if blob.numel() != sum(sizes):
        raise ValueError(f"the panels take {sum(sizes)} bytes, not {blob.numel()}")
    kinds, start = [], 0
    for part, size in zip(parts, sizes):
        kind = _PANEL_KINDS[part.kind] + (_INT8_KINDS if int8 else 0)
        kernels.kquant_pack_panels(as_bytes(part.raw), kind, blob[start:start + size])
        kinds += [kind] * -(-part.rows // PANEL)
        start += size
    per_panel = torch.tensor([super_bytes[p.kind] * nb for p in parts for _ in range(-(-p.rows // PANEL))],
                             dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(per_panel, 0)])
    return blob, offsets, torch.tensor(kinds, dtype=torch.uint8)
