"""GGUF Q4_K and Q6_K weights kept in their super-blocks, for kernels/kquant_panels.cpp.

The group-scale layouts (quant_layout.pack_quantized) spell out a float32 d and m per 32 or 16
weights and widen Q6_K's 6-bit codes to 8 bits: a Q4_K_M model's decode step then reads 1.5 times
the file's bytes. Here each panel of 16 output features keeps, per super-block of 256 weights, the
file's float16 d (and dmin) and its small integer scales, with the codes at 4 bits (Q4_K) or 4 + 2
bits (Q6_K): 4.625 and 6.5625 bits a weight. The kernel multiplies the scales back together in
registers, exactly, so the weights and the results are bit for bit those of gguf's dequantizer
followed by the float32 kernel. The byte layout is described at the top of kquant_panels.cpp.

With `int8=True` the same super-blocks are packed for the int8-activation kernel (kquant_int8.cpp):
kinds 2 and 3 instead of 0 and 1, Q6_K's high code bits in that kernel's order.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from chatloom.models.quant_layout import PANEL, SUPER_BLOCK, QuantizedWeight, _k_scales_mins

if TYPE_CHECKING:
    from chatloom.models.panel_cache import PanelCache

PANEL_KINDS = {"Q4_K": 0, "Q6_K": 1}
INT8_KINDS = 2  # added to a kind for the int8-activation kernel
SUPER_BYTES = {"Q4_K": 2368, "Q6_K": 3360}  # one panel's super-block: must match kquant_panels.cpp
_CHUNK_ROWS = 4096  # rows packed at a time: bounds the temporaries for a vocabulary-sized head


def kquant_panels_fit(parts: list[QuantizedWeight]) -> bool:
    """Whether a layer of `parts` can be kept as super-block panels: every part Q4_K or Q6_K, and
    every part but the last a whole number of panels (a panel holds one kind)."""
    return (bool(parts) and all(p.kind in PANEL_KINDS for p in parts)
            and all(p.cols % SUPER_BLOCK == 0 and p.cols == parts[0].cols for p in parts)
            and all(p.rows % PANEL == 0 for p in parts[:-1]))


def _words(q: np.ndarray, per_word: int, bits: int) -> np.ndarray:
    """Codes [P, 16, nb, 256] (uint8, one value per depth, < 2**bits) -> [P, nb, 256 / per_word * 64]
    bytes: word w's uint32 lane j holds feature j's codes at depths per_word * w + t in bits bits*t..
    (little-endian: byte b of a lane holds the 8 / bits depths from b * 8 / bits)."""
    panels, _, nb, _ = q.shape
    per_byte = 8 // bits
    q = q.reshape(panels, PANEL, nb, SUPER_BLOCK // per_word, per_word // per_byte, per_byte)
    q = np.ascontiguousarray(q.transpose(0, 2, 3, 1, 4, 5))  # [P, nb, words, 16, bytes, per_byte]
    out = q[..., 0].copy()
    for t in range(1, per_byte):
        out |= q[..., t] << (bits * t)
    return out.reshape(panels, nb, -1)


def _per_panel(a: np.ndarray, panels: int) -> np.ndarray:
    """Per-row, per-super-block values [rows, nb, n] (rows padded to panels * 16) -> [P, nb, n * 16]
    bytes, value i of feature j at i * 16 + j (for multi-byte values, their bytes in turn)."""
    rows, nb = a.shape[:2]
    a = np.pad(a, ((0, panels * PANEL - rows),) + ((0, 0),) * (a.ndim - 1))
    a = a.reshape(panels, PANEL, nb, *a.shape[2:])
    if a.ndim == 4:  # [P, 16, nb, n]
        a = a.transpose(0, 2, 3, 1)
    else:  # [P, 16, nb, n, bytes]: each value's bytes stay together
        a = a.transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(a).reshape(panels, nb, -1)


def _codes(w: QuantizedWeight, raw: np.ndarray) -> np.ndarray:
    """Unsigned codes [rows, nb, 256] (uint8) of a part's super-blocks [rows, nb, bytes], in depth order."""
    nb = raw.shape[1]
    if w.kind == "Q4_K":  # 4 chunks of 32 bytes: group 2c in the low nibbles, 2c + 1 in the high ones
        qs = raw[..., 16:144].reshape(w.rows, nb, 4, 1, 32)
        return ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(w.rows, nb, SUPER_BLOCK)
    ql, qh = raw[..., 0:128], raw[..., 128:192]  # Q6_K, as gguf's dequantizer reads them
    low = (ql.reshape(w.rows, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
    high = (qh.reshape(w.rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03
    return (low.reshape(w.rows, nb, 8, 32) | (high.reshape(w.rows, nb, 8, 32) << 4)).reshape(w.rows, nb, SUPER_BLOCK)


def _int8_high_words(high: np.ndarray) -> np.ndarray:
    """Q6_K's high code bits [P, 16, nb, 256] (values < 4) in the int8 kernel's order -> [P, nb, 16 * 64]
    bytes: in word h (16 depths), bits 2t..2t+1 of byte b of lane j hold feature j's depth
    16h + 8 (t // 2) + 2b + t % 2."""
    panels, _, nb, _ = high.shape
    q = high.reshape(panels, PANEL, nb, 16, 2, 4, 2)  # [.., h, t // 2, b, t % 2]
    q = q.transpose(0, 2, 3, 1, 5, 4, 6).reshape(panels, nb, 16, PANEL, 4, 4)  # [.., h, j, b, t]
    out = q[..., 0].copy()
    for t in range(1, 4):
        out |= q[..., t] << (2 * t)
    return np.ascontiguousarray(out).reshape(panels, nb, -1)


def _int8_high_codes(words: np.ndarray, nb: int) -> np.ndarray:
    """The inverse of _int8_high_words for one panel: [nb, 16 * 64] bytes -> [16, nb * 256]."""
    b = np.ascontiguousarray(words).reshape(nb, 16, PANEL, 4)  # [nb, h, j, b]
    q = (b[..., None] >> (2 * np.arange(4, dtype=np.uint8))) & 3  # [nb, h, j, b, t]
    q = q.reshape(nb, 16, PANEL, 4, 2, 2).transpose(2, 0, 1, 4, 3, 5)  # [j, nb, h, t // 2, b, t % 2]
    return q.reshape(PANEL, nb * SUPER_BLOCK)


def _pack_rows(w: QuantizedWeight, int8: bool = False) -> np.ndarray:
    """One part (rows already a chunk of the matrix) -> [P, nb, SUPER_BYTES] bytes."""
    nb = w.cols // SUPER_BLOCK
    raw = np.ascontiguousarray(w.raw).reshape(w.rows, nb, -1)
    panels = -(-w.rows // PANEL)
    q = np.pad(_codes(w, raw), ((0, panels * PANEL - w.rows), (0, 0), (0, 0))).reshape(panels, PANEL, nb, SUPER_BLOCK)
    if w.kind == "Q4_K":
        sc, mn = _k_scales_mins(raw[..., 4:16])
        sections = [_per_panel(raw[..., 0:2].reshape(w.rows, nb, 1, 2), panels),
                    _per_panel(raw[..., 2:4].reshape(w.rows, nb, 1, 2), panels),
                    _per_panel(sc.astype(np.uint8), panels), _per_panel(mn.astype(np.uint8), panels),
                    _words(q, 8, 4)]
    else:
        sections = [_per_panel(raw[..., 208:210].reshape(w.rows, nb, 1, 2), panels),
                    _per_panel(raw[..., 192:208], panels), _words(q & 0x0F, 8, 4),
                    _int8_high_words(q >> 4) if int8 else _words(q >> 4, 16, 2)]
    out = np.concatenate(sections, axis=-1)
    assert out.shape[-1] == SUPER_BYTES[w.kind]
    return out


def pack_kquant_panels(parts: list[QuantizedWeight], int8: bool = False, cache: "PanelCache | None" = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of `parts` stacked (a fused QKV or gate/up) as kquant_linear's blob (uint8), the panels'
    offsets into it (int64 [P + 1]) and kinds (uint8 [P]); with `int8`, for the int8-activation
    kernel. Needs kquant_panels_fit(parts). With a `cache` (panel_cache.py) the blob is mapped from
    the file an earlier start wrote, or packed into a new one."""
    if not kquant_panels_fit(parts):
        raise ValueError("super-block panels need Q4_K or Q6_K parts of whole panels")
    kinds = [PANEL_KINDS[p.kind] + (INT8_KINDS if int8 else 0) for p in parts for _ in range(-(-p.rows // PANEL))]
    sizes = [SUPER_BYTES[p.kind] for p in parts for _ in range(-(-p.rows // PANEL))]
    offsets = np.concatenate([[0], np.cumsum(np.array(sizes, np.int64) * (parts[0].cols // SUPER_BLOCK))])

    def pack(some: list[QuantizedWeight], out: torch.Tensor | None = None) -> torch.Tensor:
        return _pack_blob(some, int8, out)

    blob = pack(parts) if cache is None else cache.blob(parts, int8, int(offsets[-1]), pack)
    return blob, torch.from_numpy(offsets.astype(np.int64)), torch.tensor(kinds, dtype=torch.uint8)


def _pack_blob(parts: list[QuantizedWeight], int8: bool, out: torch.Tensor | None) -> torch.Tensor:
    """The panels' bytes of `parts`, in C++ where the kernels are built, else in numpy (the same bytes);
    written into `out` where given."""
    from chatloom.models.weight_repack import pack_panels

    native = pack_panels(parts, SUPER_BYTES, int8, out)
    if native is not None:
        return native[0]
    blocks = []
    for part in parts:
        raw = np.ascontiguousarray(part.raw).reshape(part.rows, -1)
        for r0 in range(0, part.rows, _CHUNK_ROWS):
            r1 = min(part.rows, r0 + _CHUNK_ROWS)
            blocks.append(_pack_rows(QuantizedWeight(part.kind, raw[r0:r1], r1 - r0, part.cols), int8).reshape(-1))
    blob = torch.from_numpy(np.concatenate(blocks))
    if out is None:
        return blob
    out.copy_(blob)
    return out


def _unwords(words: np.ndarray, per_word: int, bits: int) -> np.ndarray:
    """The inverse of _words for one panel's super-blocks: [nb, words * 64] bytes -> [16, nb * 256]."""
    nb = words.shape[0]
    w = np.ascontiguousarray(words).view(np.uint32).reshape(nb, -1, PANEL, 1)  # [nb, words, 16, 1]
    q = (w >> (bits * np.arange(per_word, dtype=np.uint32))) & ((1 << bits) - 1)  # [nb, words, 16, t]
    return q.transpose(2, 0, 1, 3).reshape(PANEL, nb * SUPER_BLOCK)


def _f16_rows(b: np.ndarray) -> np.ndarray:
    """[nb, 32] bytes -> [16, nb] float32 (each feature's float16 per super-block)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).T


def unpack_kquant_panels(blob: torch.Tensor, offsets: torch.Tensor, kinds: torch.Tensor, in_features: int,
                         out_features: int) -> torch.Tensor:
    """The weights [out_features, in_features] as the kernel expands them (float32; for inspection
    and tests, not for the hot path)."""
    nb = in_features // SUPER_BLOCK
    blob_np, offs = blob.numpy(), offsets.numpy()
    panels = []
    for p, kind in enumerate(kinds.tolist()):
        b = blob_np[offs[p]:offs[p + 1]].reshape(nb, -1)
        if kind % INT8_KINDS == PANEL_KINDS["Q4_K"]:
            d, dmin = _f16_rows(b[:, 0:32]), _f16_rows(b[:, 32:64])
            sc = b[:, 64:192].reshape(nb, 8, PANEL).transpose(2, 0, 1).astype(np.float32)  # [16, nb, 8]
            mn = b[:, 192:320].reshape(nb, 8, PANEL).transpose(2, 0, 1).astype(np.float32)
            q = _unwords(b[:, 320:], 8, 4).astype(np.float32).reshape(PANEL, nb, 8, 32)
            d1, m1 = d[:, :, None] * sc, -(dmin[:, :, None] * mn)
            w = d1[..., None] * q + m1[..., None]
        else:
            d = _f16_rows(b[:, 0:32])
            sc = b[:, 32:288].view(np.int8).reshape(nb, 16, PANEL).transpose(2, 0, 1).astype(np.float32)
            high = _int8_high_codes(b[:, 2336:], nb) if kind >= INT8_KINDS else _unwords(b[:, 2336:], 16, 2)
            q = (_unwords(b[:, 288:2336], 8, 4) | (high << 4)).astype(np.float32)
            w = (d[:, :, None] * sc)[..., None] * (q.reshape(PANEL, nb, 16, 16) - 32)
        panels.append(w.reshape(PANEL, in_features).astype(np.float32))
    return torch.from_numpy(np.concatenate(panels)[:out_features])
