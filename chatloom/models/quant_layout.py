"""GGUF quantized weights and the panel layouts the C++ kernels read them in.

A `QuantizedWeight` is a tensor's raw GGUF blocks (Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K,
Q6_K). `pack_quantized` turns one or several (a fused projection) into the kernels' panels of
PANEL output features: integer codes plus per-block scales and offsets, bit-identical to the
float32 dequantization; the to_/from_ layout functions convert between the float kernel's and
the int8 kernel's forms.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PANEL = 16  # output features per panel; must match kPanel in gemm.cpp


QUANT_BLOCK = 32  # weights per GGUF quantization block along K (Q4_0, Q4_1, Q8_0)
GROUP = 16  # weights per scale in the grouped layout (Q6_K, and fused layers of mixed kinds)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
QUANTIZED_KINDS = ("Q4_0", "Q4_1", "Q8_0") + K_QUANTS
SUPER_BLOCK = 256  # K-quants: weights per super-block
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


@dataclass(frozen=True)
class QuantizedWeight:
    """A GGUF matrix [rows, cols] as stored in the file: raw blocks, [rows, cols / block * block bytes]."""

    kind: str
    raw: np.ndarray
    rows: int
    cols: int


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _k_scales_mins(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 bytes of 6-bit scales and mins -> 8 of each per super-block.
    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top bits of scales 4-7; bytes 4-7 the
    same for mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high)."""
    d, m, md = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _codes_and_scales(w: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Integer codes [rows, cols] and per-group d, m [rows, cols / group] with
    w = d * code + m computed exactly as gguf's dequantizer does, and the group size."""
    if w.kind in K_QUANTS:
        return _k_codes_and_scales(w)
    nb = w.cols // QUANT_BLOCK
    raw = np.ascontiguousarray(w.raw).reshape(w.rows, nb, _BLOCK_BYTES[w.kind])
    d = _f16(raw[..., 0:2])
    if w.kind == "Q8_0":
        codes = raw[..., 2:].copy().view(np.int8)
        return codes.reshape(w.rows, w.cols), d, np.zeros_like(d), QUANT_BLOCK
    start = 4 if w.kind == "Q4_1" else 2
    qs = raw[..., start:start + 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(w.rows, w.cols)
    if w.kind == "Q4_1":
        return codes, d, _f16(raw[..., 2:4]), QUANT_BLOCK
    return codes.astype(np.int8) - np.int8(8), d, np.zeros_like(d), QUANT_BLOCK  # Q4_0: d * (q - 8)


def _k_codes_and_scales(w: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q4_K / Q5_K: super-blocks of 8 groups of 32, w = (d * scale) * q - dmin * min;
    Q6_K: 16 groups of 16, w = (d * scale) * (q - 32). The products are exact in float32."""
    nb = w.cols // SUPER_BLOCK
    raw = np.ascontiguousarray(w.raw).reshape(w.rows, nb, _BLOCK_BYTES[w.kind])
    shape = (w.rows, w.cols)
    if w.kind == "Q6_K":
        ql, qh = raw[..., 0:128], raw[..., 128:192]
        scales = raw[..., 192:208].copy().view(np.int8).astype(np.float32)
        d = _f16(raw[..., 208:210])[..., None] * scales  # [rows, nb, 16]
        low = ((ql.reshape(w.rows, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F)
        high = ((qh.reshape(w.rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03)
        q = low.reshape(w.rows, nb, 8, 32) | (high.reshape(w.rows, nb, 8, 32) << 4)
        codes = q.astype(np.int8) - np.int8(32)
        return codes.reshape(shape), d.reshape(w.rows, -1), np.zeros((w.rows, nb * 16), np.float32), GROUP
    d, dmin = _f16(raw[..., 0:2])[..., None], _f16(raw[..., 2:4])[..., None]
    sc, mn = _k_scales_mins(raw[..., 4:16])
    qs = raw[..., -128:]
    q = ((qs.reshape(w.rows, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F)
    q = q.reshape(w.rows, nb, 8, 32)
    if w.kind == "Q5_K":
        qh = raw[..., 16:48].reshape(w.rows, nb, 1, 32)
        q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 0x01) << 4)
    return q.reshape(shape), (d * sc).reshape(w.rows, -1), -(dmin * mn).reshape(w.rows, -1), QUANT_BLOCK


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


def to_float_kernel_layout(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_quantized's panels (group 32) -> quantized_linear's layout, same values, fewer bytes
    and instructions per weight:

    - 4-bit codes [P, K, 8] -> the same shape, each 8 depths of a panel now 16 little-endian
      uint32 words, word j holding feature j's codes at depths 8g..8g+7 (depth 8g+t in bits
      4t..4t+3): one load serves 8 depths, and a shift by 4 moves to the next one.
    - scales -> float16 when every d and m is exactly a float16 (Q4_1, Q8_0 and Q4_0 store them
      so; K-quants' products of two scales often are not): a decode step then reads 5 bits per
      4-bit weight instead of 6, and widening back to float32 is exact, so results keep their bits.

    8-bit codes [P, K, 16] are unchanged."""
    if codes.shape[2] == 8:
        panels, k, _ = codes.shape
        q = torch.cat([codes & 0x0F, codes >> 4], dim=2).to(torch.int64)  # [P, K, 16] features
        shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 1, 8, 1)
        words = (q.view(panels, k // 8, 8, PANEL) << shifts).sum(dim=2).to(torch.int32)  # [P, K/8, 16]
        codes = words.contiguous().view(torch.uint8).reshape(panels, k, 8)
    half = scales.half()
    if torch.equal(half.float(), scales):
        scales = half.contiguous()
    return codes, scales


def from_float_kernel_layout(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of to_float_kernel_layout (float32 scales)."""
    if codes.shape[2] == 8:
        panels, k, _ = codes.shape
        words = codes.contiguous().view(torch.int32).view(panels, k // 8, 1, PANEL).to(torch.int64)
        q = ((words >> (4 * torch.arange(8, dtype=torch.int64)).view(1, 1, 8, 1)) & 0x0F).reshape(panels, k, PANEL)
        codes = (q[..., :8] | (q[..., 8:] << 4)).to(torch.uint8).contiguous()
    return codes, scales.float()


def q4_0_as_q4_1(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 panels (int8 codes q - 8 [P, K, 16], m = 0) as Q4_1 ones (4-bit q, m = -8 d): the
    same weights exactly, in the form the int8 kernel reads."""
    q = (codes.to(torch.int16) + 8).to(torch.uint8)
    nibbles = q[..., :8] | (q[..., 8:] << 4)
    scales = scales.clone()
    scales[:, :, 1, :] = -8 * scales[:, :, 0, :]
    return nibbles.contiguous(), scales


def quantized_layout(parts: list[QuantizedWeight]) -> str:
    """How a layer made of `parts` is kept: "nibbles" (4-bit codes, a d and m per 32: Q4_1,
    Q4_K), "int8" (8-bit codes, a d and m per 32: Q8_0, Q4_0, Q5_K) or "grouped" (8-bit
    codes, a d and m per 16: Q6_K, and fused layers whose parts differ in kind)."""
    kinds = {p.kind for p in parts}
    if len(kinds) > 1 or kinds == {"Q6_K"}:
        return "grouped"
    return "nibbles" if kinds <= {"Q4_1", "Q4_K"} else "int8"


def pack_quantized(parts: list[QuantizedWeight]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `parts` stacked (a fused QKV or gate/up), as the kernel's panels: codes
    [P, K, 8] uint8 (nibbles: two rows per byte) or [P, K, 16] int8, and scales
    [P, K / group, 2, 16] float32 (d, then m), the group being 32, or 16 when grouped."""
    layout = quantized_layout(parts)
    decoded = [_codes_and_scales(p) for p in parts]
    group = GROUP if layout == "grouped" else QUANT_BLOCK
    codes = np.concatenate([c.astype(np.int16) for c, *_ in decoded]) if layout == "grouped" \
        else np.concatenate([c for c, *_ in decoded])
    # Per-32 scales repeat over both halves in the grouped layout (same values, finer grid).
    d = np.concatenate([np.repeat(x, g // group, axis=1) for _, x, _, g in decoded])
    m = np.concatenate([np.repeat(x, g // group, axis=1) for _, _, x, g in decoded])
    cols = codes.shape[1]
    rows = codes.shape[0]
    panels = -(-rows // PANEL)
    pad = panels * PANEL - rows
    codes = np.pad(codes, ((0, pad), (0, 0)))
    d, m = np.pad(d, ((0, pad), (0, 0))), np.pad(m, ((0, pad), (0, 0)))
    codes = codes.reshape(panels, PANEL, cols).transpose(0, 2, 1)  # [P, K, 16]
    if layout == "nibbles":
        codes = (codes[..., :8] | (codes[..., 8:] << 4)).astype(np.uint8)
    elif layout == "grouped" or codes.dtype != np.int8:
        codes = codes.astype(np.int8)  # Q5_K codes 0..31, Q4_K 0..15, Q6_K -32..31: all fit
    scales = np.stack([d.reshape(panels, PANEL, -1), m.reshape(panels, PANEL, -1)], axis=1)  # [P, 2, 16, nb]
    scales = scales.transpose(0, 3, 1, 2)  # [P, nb, 2, 16]
    return torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(np.ascontiguousarray(scales))
