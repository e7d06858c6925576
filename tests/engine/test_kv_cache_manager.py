"""The KV-cache manager over its block pool: invariants under any sequence of operations, prefix reuse."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from chatloom.engine.block_pool import BlockPool
from chatloom.engine.kv_cache_manager import KVCacheManager
from chatloom.engine.kv_events import KVEventLog
from chatloom.engine.sampling_params import SamplingParams
from chatloom.engine.sequence import Sequence


def manager(num_blocks: int, block_size: int, events: KVEventLog | None = None,
            copy_prefix=None) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, block_size, events=events), copy_prefix=copy_prefix)


def check_invariants(kv: KVCacheManager, live: list[Sequence]) -> None:
    pool = kv.pool
    refs = [0] * kv.num_blocks
    for seq in live:
        for b in seq.block_table:
            refs[b] += 1
    for block in pool.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == refs[block.block_id]
        in_free = block.block_id in pool.free
        assert in_free == (block.ref_count == 0), "a block is either free or in use, never both"
    for key, block_id in pool.cached.items():
        assert pool.blocks[block_id].key == key
    if pool.events is not None:
        # Replaying the published feed from the start gives exactly the keys the cache holds.
        replayed: set[int] = set()
        for e in pool.events.since(0).events:
            replayed = replayed | set(e.keys) if e.kind == "stored" else replayed - set(e.keys)
        assert replayed == set(pool.cached)


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 10_000)), max_size=60)


def run_ops(kv: KVCacheManager, ops, pools: "FakePools | None" = None) -> list[Sequence]:
    """Apply add/grow/free operations, checking the invariants (and, with pools, every live
    sequence's K/V) after each; returns the live sequences."""
    bs = kv.block_size
    live: list[Sequence] = []

    def compute(seq: Sequence) -> None:
        if pools is not None:
            pools.compute(seq, bs)
        seq.num_computed_tokens = len(seq)
        kv.register_full_blocks(seq)

    for i, (op, arg) in enumerate(ops):
        if op == "add":
            # Small alphabet so prefixes repeat and the prefix cache is exercised.
            tokens = [(arg >> k) % 3 for k in range(1 + arg % 12)]
            seq = Sequence(f"s{i}", tokens, SamplingParams(max_tokens=1))
            if kv.can_allocate(seq):
                kv.allocate(seq)
                if pools is not None:
                    pools.check(seq, bs)  # what the cache supplied, before anything is computed
                compute(seq)
                live.append(seq)
        elif op == "grow" and live:
            seq = live[arg % len(live)]
            seq.token_ids.append(arg % 3)
            if kv.can_grow(seq, len(seq)):
                kv.grow(seq, len(seq))
                compute(seq)
            else:
                seq.token_ids.pop()
        elif op == "free" and live:
            kv.free_sequence(live.pop(arg % len(live)))
        check_invariants(kv, live)
        for seq in live if pools is not None else ():
            pools.check(seq, bs)
    return live


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 24))
def test_kv_cache_manager_invariants(ops, block_size, num_blocks):
    kv = manager(num_blocks, block_size, events=KVEventLog("", block_size))
    for seq in run_ops(kv, ops):
        kv.free_sequence(seq)
    check_invariants(kv, [])
    assert kv.num_free_blocks == num_blocks


class FakePools:
    """What each slot of the pool holds, as the tokens its K/V was computed from (K and V of the token
    at position p depend on tokens[:p + 1] and nothing else): the block manager's copy hook moves them."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.copies: list[tuple[int, int, int]] = []

    def copy(self, src: int, dst: int, n: int) -> None:
        self.copies.append((src, dst, n))
        for off in range(n):
            self.slots[(dst, off)] = self.slots[(src, off)]

    def compute(self, seq: Sequence, bs: int) -> None:
        """Write the K/V of seq's uncomputed tokens, as a forward pass does, and mark them computed."""
        for p in range(seq.num_computed_tokens, len(seq)):
            self.slots[(seq.block_table[p // bs], p % bs)] = tuple(seq.token_ids[:p + 1])
        seq.num_computed_tokens = len(seq)

    def prefilled(self, kv: KVCacheManager, request_id: str, tokens: list[int]) -> Sequence:
        """A sequence given blocks, computed and published in kv's prefix cache."""
        seq = Sequence(request_id, tokens, SamplingParams(max_tokens=1))
        kv.allocate(seq)
        self.compute(seq, kv.block_size)
        kv.register_full_blocks(seq)
        return seq

    def check(self, seq: Sequence, bs: int) -> None:
        for p in range(seq.num_computed_tokens):
            assert self.slots.get((seq.block_table[p // bs], p % bs)) == tuple(seq.token_ids[:p + 1]), \
                f"{seq.request_id}: position {p} holds another prefix's K/V"


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([2, 3, 4]), num_blocks=st.integers(4, 24))
def test_reused_cached_tokens_hold_their_own_prefix(ops, block_size, num_blocks):
    """With reuse of part of a block: every computed slot of every live sequence holds the K/V of
    that sequence's own prefix, whatever was allocated, evicted or copied before."""
    pools = FakePools()
    kv = manager(num_blocks, block_size, events=KVEventLog("", block_size), copy_prefix=pools.copy)
    run_ops(kv, ops, pools)
    assert kv.hit_tokens <= kv.query_tokens


def test_part_of_a_cached_block_is_copied_into_a_fresh_one():
    pools = FakePools()
    kv = manager(16, 4, copy_prefix=pools.copy)
    a = pools.prefilled(kv, "a", list(range(10)))
    b = Sequence("b", [0, 1, 2, 3, 4, 5, 99, 98], SamplingParams(max_tokens=1))
    kv.allocate(b)
    assert b.block_table[0] == a.block_table[0]  # the whole block is shared
    assert b.block_table[1] != a.block_table[1]  # the partly matching one is copied, not shared
    assert pools.copies == [(a.block_table[1], b.block_table[1], 2)]
    assert b.num_computed_tokens == 6 and b.metrics.num_cached_tokens == 6
    pools.check(b, 4)
    assert kv.hit_tokens == 6 and kv.query_tokens == 9 + 7
    # A prompt that is all cached still leaves its last token to compute.
    c = Sequence("c", list(range(8)), SamplingParams(max_tokens=1))
    kv.allocate(c)
    assert c.num_computed_tokens == 7
    # Without the hook only whole blocks are reused.
    plain = manager(16, 4)
    FakePools().prefilled(plain, "a", list(range(10)))
    b2 = Sequence("b", [0, 1, 2, 3, 4, 5, 99, 98], SamplingParams(max_tokens=1))
    plain.allocate(b2)
    assert b2.num_computed_tokens == 4


def test_the_copy_is_made_before_the_donor_block_can_be_handed_out():
    pools = FakePools()
    kv = manager(3, 4, copy_prefix=pools.copy)
    a = pools.prefilled(kv, "a", list(range(8)))
    donor = a.block_table[1]
    kv.free_sequence(a)  # both blocks stay cached on the free list
    take = kv.pool.get_new_block

    def take_and_overwrite():  # a block handed out is as good as overwritten
        block = take()
        for off in range(4):
            pools.slots.pop((block.block_id, off), None)
        return block

    kv.pool.get_new_block = take_and_overwrite
    b = Sequence("b", [0, 1, 2, 3, 4, 5, 9, 9, 9], SamplingParams(max_tokens=1))
    kv.allocate(b)  # needs every block: the donor itself is handed out as b's third
    assert b.block_table[2] == donor and pools.copies == [(donor, b.block_table[1], 2)]
    assert b.num_computed_tokens == 6
    pools.check(b, 4)


def test_a_donor_handed_out_as_the_fresh_block_keeps_its_slots_in_place():
    pools = FakePools()
    kv = manager(2, 4, copy_prefix=pools.copy)
    a = pools.prefilled(kv, "a", list(range(8)))
    blocks = list(a.block_table)
    kv.free_sequence(a)
    b = Sequence("b", [0, 1, 2, 3, 4, 5, 9], SamplingParams(max_tokens=1))
    kv.allocate(b)
    assert b.block_table == blocks  # the second is the donor, handed out again
    assert pools.copies == []  # nothing to copy: the slots are where they were
    assert b.num_computed_tokens == 6
    pools.check(b, 4)


def test_prefix_hit_reuses_blocks_and_counts():
    kv = manager(16, 4)
    a = Sequence("a", list(range(10)), SamplingParams(max_tokens=1))
    kv.allocate(a)
    a.num_computed_tokens = 10
    kv.register_full_blocks(a)
    b = Sequence("b", list(range(8)) + [99, 98, 97], SamplingParams(max_tokens=1))
    kv.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_computed_tokens == 8
    assert kv.pool.blocks[a.block_table[0]].ref_count == 2
    kv.free_sequence(a)
    kv.free_sequence(b)
    # Freed blocks keep their contents: a third request still hits them.
    c = Sequence("c", list(range(9)), SamplingParams(max_tokens=1))
    kv.allocate(c)
    assert c.num_computed_tokens == 8
    assert kv.hit_tokens == 16
    assert kv.query_tokens == 9 + 10 + 8  # every token but each prompt's last could have been a hit


def test_whole_prompt_cached_still_leaves_a_token_to_compute():
    kv = manager(8, 4)
    a = Sequence("a", list(range(8)), SamplingParams(max_tokens=1))
    kv.allocate(a)
    a.num_computed_tokens = 8
    kv.register_full_blocks(a)
    b = Sequence("b", list(range(8)), SamplingParams(max_tokens=1))
    kv.allocate(b)
    assert b.num_computed_tokens == 4  # the last block is recomputed for its logits
