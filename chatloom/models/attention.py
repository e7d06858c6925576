"""Attention over a paged KV cache, in plain PyTorch.

The engine lays out one step's tokens as a flat batch: first one token for each
decoding sequence, then the prefill chunks one after another. K/V are written to
the pool at `slot_mapping` and read back through block tables, so a sequence
never needs contiguous memory and the result does not depend on block size or
on how a prompt was chunked.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSegment:
    """One prefill chunk: `q_len` new tokens whose context ends at `context_len`."""

    q_start: int
    q_len: int
    context_len: int
    block_table: torch.Tensor | None  # [num_blocks] int64; None when the chunk is the whole context
    mask: torch.Tensor | None = None  # [q_len, context_len] bool, built once per step
    # For the C++ kernel: int32 table [1, num_blocks], and each query's number of visible keys.
    kernel_table: torch.Tensor | None = None
    kernel_kv_lens: torch.Tensor | None = None


@dataclass
class AttentionBatch:
    """Where one step's tokens read and write K/V.

    With `kv_caches` empty the batch is run without any cache: every segment is a
    whole sequence attending causally to itself (the reference path).
    """

    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks]
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSegment] = field(default_factory=list)
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, flat slot in the pool
    block_size: int = 16
    # Set when the compiled kernel is used: int32 decode tables, rows and key counts.
    kernels: object | None = None
    decode_rows: torch.Tensor | None = None
    decode_kv_lens: torch.Tensor | None = None
    # Every prefill segment's queries in one kernel call: int32 tables [segments, max_blocks], each
    # query's table row and key count (set by set_prefill_tables).
    prefill_block_tables: torch.Tensor | None = None
    prefill_rows: torch.Tensor | None = None
    prefill_kv_lens: torch.Tensor | None = None

    @property
    def decode_only(self) -> bool:
        """Only decode queries, with the compiled kernel's tables (decode_attention applies)."""
        return self.num_decode > 0 and not self.prefills and self.decode_rows is not None

    def set_prefill_tables(self) -> None:
        """Gather the segments' kernel tables into the one call's tensors; every segment must have its
        kernel_table and kernel_kv_lens, and the segments must follow the decodes back to back."""
        tables = [seg.kernel_table[0] for seg in self.prefills]
        width = max(len(t) for t in tables)
        padded = torch.zeros(len(tables), width, dtype=torch.int32)
        for r, t in enumerate(tables):
            padded[r, :len(t)] = t
        self.prefill_block_tables = padded
        self.prefill_rows = torch.repeat_interleave(torch.arange(len(tables), dtype=torch.int32),
                                                    torch.tensor([seg.q_len for seg in self.prefills]))
        self.prefill_kv_lens = torch.cat([seg.kernel_kv_lens for seg in self.prefills])

    @classmethod
    def dense(cls, seq_lens: list[int]) -> "AttentionBatch":
        """Several whole sequences, no cache, each causal over itself."""
        segs, start = [], 0
        for n in seq_lens:
            segs.append(PrefillSegment(start, n, n, None))
            start += n
        return cls(prefills=segs)


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a pool of `dtype` keeps it: rounded to nearest; float16 saturates at its largest finite
    value (65504) rather than store an infinity."""
    if dtype == torch.float16:
        x = x.clamp(-65504.0, 65504.0)
    return x.to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            causal: bool, scale: float, softcap: float | None = None) -> torch.Tensor:
    # q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D]; mask broadcasts to [B, Hq, Lq, Lk], True = visible
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    # SDPA cannot soft-cap the scores: the plain computation, as Gemma 2 defines it.
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


def _window_mask(q_pos: torch.Tensor, context_len: int, window: int | None) -> torch.Tensor:
    """[Lq, context_len] bool: causal, and within `window` positions when given."""
    kv = torch.arange(context_len).unsqueeze(0)
    q_pos = q_pos.unsqueeze(1)
    mask = kv <= q_pos
    if window is not None:
        mask &= kv > q_pos - window
    return mask


def _windowed_attention(q, k, v, k_pool, v_pool, batch: AttentionBatch, out: torch.Tensor, scale: float,
                        window: int | None, softcap: float | None) -> torch.Tensor:
    """Sliding-window and/or soft-capped attention, in PyTorch (the C++ kernel does neither).
    The pool keeps every position; the window is applied by the mask, and only the blocks
    that can hold a key inside the window are read (decode: O(window) per token; a prefill
    chunk: its own length plus the window)."""
    nd = batch.num_decode
    if nd:
        tables = batch.decode_block_tables.long()
        lens = batch.decode_kv_lens.long()
        bs = k_pool.shape[1]
        first = torch.zeros_like(lens)
        if window is not None:
            # Gather only the blocks that can hold the window's keys: a windowed layer's decode
            # reads O(window), not O(context).
            span = min(tables.shape[1], -(-window // bs) + 1)
            first = torch.clamp((lens - window).clamp(min=0) // bs, max=tables.shape[1] - span)
            tables = tables.gather(1, first.unsqueeze(1) + torch.arange(span))
        kd = k_pool[tables].to(q.dtype).flatten(1, 2).transpose(1, 2)  # [nd, Hkv, L, D]
        vd = v_pool[tables].to(q.dtype).flatten(1, 2).transpose(1, 2)
        kv = (first * bs).unsqueeze(1) + torch.arange(kd.shape[2]).unsqueeze(0)  # absolute positions
        mask = kv < lens.unsqueeze(1)
        if window is not None:
            mask &= kv >= (lens - window).unsqueeze(1)
        out[:nd] = _attend(q[:nd].unsqueeze(2), kd, vd, mask[:, None, None, :], False, scale, softcap).squeeze(2)
    for seg in batch.prefills:
        s, e, n = seg.q_start, seg.q_start + seg.q_len, seg.context_len
        table = seg.block_table if seg.block_table is not None else (
            seg.kernel_table[0].long() if seg.kernel_table is not None else None)
        lo = 0
        if table is None:  # the chunk is the whole context
            ks, vs = k[s:e], v[s:e]
        else:
            if window is not None:
                # Only the blocks that can hold a key some query of the chunk sees.
                first = max(0, n - seg.q_len - window + 1) // k_pool.shape[1]
                table, lo = table[first:], first * k_pool.shape[1]
            ks = k_pool[table].to(q.dtype).flatten(0, 1)[:n - lo]
            vs = v_pool[table].to(q.dtype).flatten(0, 1)[:n - lo]
        mask = _window_mask(torch.arange(n - seg.q_len, n), n, window)[:, lo:]
        res = _attend(q[s:e].transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
                      vs.transpose(0, 1).unsqueeze(0), mask, False, scale, softcap)
        out[s:e] = res.squeeze(0).transpose(0, 1)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cache: tuple[torch.Tensor, torch.Tensor] | None,
                    batch: AttentionBatch, scale: float | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]. Cache pools: [num_blocks, block_size, Hkv, D], of q's
    dtype or a 16-bit one (float16/bfloat16: half the bytes, values rounded as they are stored).
    `scale` multiplies the scores (default D ** -0.5); with `window`, a query at position p
    sees keys p - window + 1 .. p only; with `softcap`, scores become tanh(s / cap) * cap."""
    out = torch.empty_like(q)
    k_pool = v_pool = None
    nd = batch.num_decode
    kern = batch.kernels
    if cache is not None:
        k_pool, v_pool = cache
        if kern is not None and k.dtype == torch.float32 and hasattr(kern, "write_pool_rows"):
            # Row by row on every thread, rounded as the pool keeps them (index_copy_ runs on one).
            kern.write_pool_rows(k_pool, batch.slot_mapping, k)
            kern.write_pool_rows(v_pool, batch.slot_mapping, v)
        else:
            flat_k = k_pool.view(-1, k_pool.shape[2], k_pool.shape[3])
            flat_v = v_pool.view(-1, v_pool.shape[2], v_pool.shape[3])
            flat_k.index_copy_(0, batch.slot_mapping, as_stored(k, k_pool.dtype))
            flat_v.index_copy_(0, batch.slot_mapping, as_stored(v, v_pool.dtype))

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if window is not None or softcap is not None or (batch.prefills and batch.prefill_kv_lens is None):
        # Only the PyTorch paths read this step's fresh K/V (the kernel reads the pool). With a 16-bit
        # pool they see them rounded as the pool keeps them, so a token's result does not depend on
        # whether its keys came fresh or from the cache; then in q's dtype.
        if k_pool is not None and k_pool.dtype != k.dtype:
            k, v = as_stored(k, k_pool.dtype), as_stored(v, v_pool.dtype)
        k, v = k.to(q.dtype), v.to(q.dtype)
    if window is not None or softcap is not None:
        return _windowed_attention(q, k, v, k_pool, v_pool, batch, out, scale, window, softcap)
    if nd and kern is not None:
        out[:nd] = kern.paged_attention(q[:nd].contiguous(), k_pool, v_pool, batch.decode_block_tables,
                                        batch.decode_rows, batch.decode_kv_lens, scale)
    elif nd:
        tables = batch.decode_block_tables
        kd = k_pool[tables].to(q.dtype).flatten(1, 2).transpose(1, 2)  # [nd, Hkv, L, D]
        vd = v_pool[tables].to(q.dtype).flatten(1, 2).transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [nd, Hq, 1, D]
        out[:nd] = _attend(qd, kd, vd, batch.decode_mask, False, scale).squeeze(2)

    if batch.prefill_kv_lens is not None:
        # All prefill queries (they follow the decodes) in one call: the kernel cuts them into tiles.
        out[nd:] = kern.paged_attention(q[nd:].contiguous(), k_pool, v_pool, batch.prefill_block_tables,
                                        batch.prefill_rows, batch.prefill_kv_lens, scale)
        return out
    # Without the kernel: PyTorch's SDPA, segment by segment.
    for seg in batch.prefills:
        s, e = seg.q_start, seg.q_start + seg.q_len
        qs = q[s:e].transpose(0, 1).unsqueeze(0)
        if seg.block_table is None:
            # The chunk is the whole context: attend to its own fresh K/V.
            ks = k[s:e].transpose(0, 1).unsqueeze(0)
            vs = v[s:e].transpose(0, 1).unsqueeze(0)
            res = _attend(qs, ks, vs, None, True, scale)
        else:
            n = seg.context_len
            ks = k_pool[seg.block_table].to(q.dtype).flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
            vs = v_pool[seg.block_table].to(q.dtype).flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
            res = _attend(qs, ks, vs, seg.mask, False, scale)
        out[s:e] = res.squeeze(0).transpose(0, 1)
    return out


def chunk_mask(q_len: int, context_len: int) -> torch.Tensor:
    """Causal mask for the last `q_len` queries of a `context_len`-token context."""
    q_pos = torch.arange(context_len - q_len, context_len).unsqueeze(1)
    return torch.arange(context_len).unsqueeze(0) <= q_pos
