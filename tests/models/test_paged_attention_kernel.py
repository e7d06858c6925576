"""The C++ paged attention (kernels/paged_attention.cpp) on each instruction path.

Every path must match a float64 reference over the gathered keys, and give a query the same bits
whether it runs alone or in a batch (and whichever thread split the batch's size picks), for head
sizes the AVX-512 path takes (16-128) and one it leaves to AVX2 (80), GQA groups of 1-4, lengths
that do and do not fill its groups of four positions.
"""
from __future__ import annotations

import pytest
import torch

from chatloom.models.kernels import load_kernels

kernels = load_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels unavailable")


PATHS = kernels.paged_attention_isas() if kernels is not None else []


def _case(d: int, hq: int, hkv: int, lens: list[int], block_size: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = width * len(lens) + 3
    k_pool = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_pool = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: width * len(lens)].view(len(lens), width).to(torch.int32)
    q = torch.randn(len(lens), hq, d, generator=gen)
    return q, k_pool, v_pool, tables, torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def _reference(q, k_pool, v_pool, tables, kv_lens, scale) -> torch.Tensor:
    bs, hkv = k_pool.shape[1], k_pool.shape[2]
    out = []
    for i, n in enumerate(kv_lens.tolist()):
        slots = [int(tables[i, t // bs]) * bs + t % bs for t in range(n)]
        k = k_pool.view(-1, hkv, k_pool.shape[3])[slots].double()  # [n, hkv, d]
        v = v_pool.view(-1, hkv, v_pool.shape[3])[slots].double()
        group = q.shape[1] // hkv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v))
    return torch.stack(out).float()


@pytest.mark.parametrize("path", PATHS)
# (64, 8, 1) and (16, 12, 2): groups wider than the AVX-512 path carries in registers in one pass.
@pytest.mark.parametrize("d,hq,hkv", [(16, 4, 2), (32, 4, 4), (64, 9, 3), (128, 8, 2), (80, 4, 1), (64, 8, 1),
                                      (16, 12, 2), (64, 12, 4)])
def test_matches_float64_reference(path, d, hq, hkv):
    lens = [1, 3, 4, 5, 17, 130, 301]
    q, kp, vp, tables, rows, kv_lens = _case(d, hq, hkv, lens)
    out = kernels.paged_attention(q, kp, vp, tables, rows, kv_lens, d ** -0.5, path)
    torch.testing.assert_close(out, _reference(q, kp, vp, tables, kv_lens, d ** -0.5), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
# (64, 12, 4): a row-wise job whose four KV heads' value sums do not all fit the registers.
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (16, 4, 2), (64, 12, 4), (32, 12, 4)])
def test_a_query_gets_the_same_bits_alone_or_in_a_batch(path, pool_dtype, d, hq, hkv):
    # Alone, a short query runs on one thread with all heads in one job, and a long one in one job
    # per KV head (passes over each head's part of the rows); in a batch of seven every query is one
    # job over all its KV heads (whole rows at a time), split over threads: its bits must not change.
    lens = [2, 7, 400, 9, 1000, 33, 5]
    q, kp, vp, tables, rows, kv_lens = _case(d, hq, hkv, lens, block_size=16, seed=1)
    kp, vp = kp.to(pool_dtype), vp.to(pool_dtype)
    batch = kernels.paged_attention(q, kp, vp, tables, rows, kv_lens, 0.125, path)
    for i in range(len(lens)):
        alone = kernels.paged_attention(q[i:i + 1], kp, vp, tables, rows[i:i + 1], kv_lens[i:i + 1], 0.125, path)
        assert torch.equal(alone[0], batch[i]), (path, i)


def test_an_unknown_path_is_refused():
    q, kp, vp, tables, rows, kv_lens = _case(16, 2, 1, [3])
    with pytest.raises(RuntimeError, match=r"attention(.s avx1024)? path"):
        kernels.paged_attention(q, kp, vp, tables, rows, kv_lens, 0.25, "avx1024")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (16, 4, 2), (80, 4, 1), (64, 8, 1)])
def test_a_16_bit_pool_matches_the_reference_over_its_widened_values(path, pool_dtype, d, hq, hkv):
    # The kernel widens each stored value to float32 exactly, so against the float64 reference over
    # those same values it is as close as the float32 pool is (80: the portable loops).
    q, kp, vp, tables, rows, kv_lens = _case(d, hq, hkv, [1, 4, 5, 17, 130, 301], seed=2)
    kp, vp = kp.to(pool_dtype), vp.to(pool_dtype)
    out = kernels.paged_attention(q, kp, vp, tables, rows, kv_lens, d ** -0.5, path)
    assert out.dtype == torch.float32
    ref = _reference(q, kp.float(), vp.float(), tables, kv_lens, d ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)


def test_pools_of_two_types_or_a_16_bit_pool_with_float64_queries_are_refused():
    q, kp, vp, tables, rows, kv_lens = _case(16, 4, 2, [3])
    with pytest.raises(RuntimeError, match="one type"):
        kernels.paged_attention(q, kp.half(), vp, tables, rows, kv_lens, 0.25)
    with pytest.raises(RuntimeError, match="float32 queries"):
        kernels.paged_attention(q.double(), kp.half(), vp.half(), tables, rows, kv_lens, 0.25)


def _prefill_case(d: int, hq: int, hkv: int, chunks: list[tuple[int, int]], pool_dtype=torch.float32, seed: int = 3):
    """Prefill-shaped queries: for each (start, n), n consecutive queries of one sequence, query j of
    the chunk seeing start + j + 1 positions (a whole prompt when start is 0)."""
    gen = torch.Generator().manual_seed(seed)
    block_size = 16
    width = max(-(-(s + n) // block_size) for s, n in chunks)
    num_blocks = width * len(chunks) + 5
    k_pool = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(pool_dtype)
    v_pool = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(pool_dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: width * len(chunks)].view(len(chunks), width).to(torch.int32)
    rows = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, (_, n) in enumerate(chunks)])
    kv_lens = torch.cat([torch.arange(s + 1, s + n + 1, dtype=torch.int32) for s, n in chunks])
    q = torch.randn(len(rows), hq, d, generator=gen)
    return q, k_pool, v_pool, tables, rows, kv_lens


# Chunks that cross the tiles' 8 queries and 64-position spans, short ones that fit in neither, and
# chunks whose context starts far back (a prompt continued after a prefix-cache hit or a chunk).
PREFILL_CHUNKS = [(0, 1), (0, 7), (0, 8), (0, 9), (0, 70), (5, 3), (64, 17), (130, 40), (0, 200), (333, 65)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.bfloat16])
# Groups of 1 and 2 query heads per KV head (SmolLM2-1.7B's 32 of each) run several queries' rows at once.
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (16, 12, 2), (128, 8, 2), (32, 4, 4), (80, 4, 1), (64, 4, 4),
                                      (128, 3, 3), (16, 4, 2)])
def test_prefill_queries_get_the_bits_each_gets_alone(path, pool_dtype, d, hq, hkv):
    # Runs of queries of one sequence go through the tiles; each query alone through the one-query
    # job a decode step runs. Same bits, so a prompt's tokens do not depend on how it was split.
    q, kp, vp, tables, rows, kv_lens = _prefill_case(d, hq, hkv, PREFILL_CHUNKS, pool_dtype)
    batch = kernels.paged_attention(q, kp, vp, tables, rows, kv_lens, d ** -0.5, path)
    for i in range(len(rows)):
        alone = kernels.paged_attention(q[i:i + 1], kp, vp, tables, rows[i:i + 1], kv_lens[i:i + 1], d ** -0.5, path)
        assert torch.equal(alone[0], batch[i]), (path, i)
    ref = _reference(q, kp.float(), vp.float(), tables[rows.long()], kv_lens, d ** -0.5)
    torch.testing.assert_close(batch, ref, rtol=1e-5, atol=2e-6)


def test_a_prompt_split_into_chunks_gets_the_same_bits():
    # One 150-token prompt in one call, and the same queries in chunks of 1, 8 and 50 calls.
    q, kp, vp, tables, rows, kv_lens = _prefill_case(64, 9, 3, [(0, 150)])
    whole = kernels.paged_attention(q, kp, vp, tables, rows, kv_lens, 0.125)
    for size in (1, 8, 50):
        parts = [kernels.paged_attention(q[s:s + size], kp, vp, tables, rows[s:s + size], kv_lens[s:s + size], 0.125)
                 for s in range(0, 150, size)]
        assert torch.equal(torch.cat(parts), whole), size


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 200])  # one thread's share, and enough to spread over the threads
def test_fresh_rows_are_written_to_the_pool_as_index_copy_writes_them(pool_dtype, rows):
    """write_pool_rows stores what index_copy_ of the rows rounded as the pool keeps them (as_stored)
    would: the same bits, float16 saturating at 65504, NaN staying NaN; rows may be views into a
    wider tensor (v in a fused QKV projection); other slots are left alone."""
    from chatloom.models.attention import as_stored

    gen = torch.Generator().manual_seed(rows)
    hkv, d, blocks, bs = 3, 64, 40, 8
    fused = torch.randn(rows, 5 * hkv * d, generator=gen) * 3
    fresh = fused[:, 2 * hkv * d: 3 * hkv * d].view(rows, hkv, d)  # a strided view, as v is
    fresh[0, 0, :4] = torch.tensor([1e5, -7e4, float("inf"), float("nan")])  # past float16's range
    fresh[0, 0, 4] = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)  # a NaN of low payload
    slots = torch.randperm(blocks * bs, generator=gen)[:rows]
    pool = torch.randn(blocks, bs, hkv, d, generator=gen).to(pool_dtype)
    want = pool.clone()
    want.view(-1, hkv, d).index_copy_(0, slots, as_stored(fresh, pool_dtype))
    kernels.write_pool_rows(pool, slots, fresh)
    same = (pool.view(torch.int16 if pool_dtype != torch.float32 else torch.int32)
            == want.view(torch.int16 if pool_dtype != torch.float32 else torch.int32))
    both_nan = pool.float().isnan() & want.float().isnan()
    assert bool((same | both_nan).all())
    assert int(both_nan.sum()) == 2


def test_a_slot_outside_the_pool_is_refused_before_anything_is_written():
    pool = torch.zeros(4, 8, 3, 64)
    with pytest.raises(RuntimeError, match="slot 32 out of range"):
        kernels.write_pool_rows(pool, torch.tensor([3, 32]), torch.ones(2, 3, 64))
    assert not bool(pool.any())
    with pytest.raises(RuntimeError, match="pool's H and D"):
        kernels.write_pool_rows(pool, torch.tensor([3]), torch.ones(1, 2, 64))
