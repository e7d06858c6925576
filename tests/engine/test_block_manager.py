"""Property tests: the block manager's invariants hold under any sequence of operations."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from chatloom.engine.block_manager import BlockManager
from chatloom.engine.kv_events import KVEventLog
from chatloom.engine.sampling_params import SamplingParams
from chatloom.engine.sequence import Sequence


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for seq in live:
        for b in seq.block_table:
            refs[b] += 1
    for block in bm.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == refs[block.block_id]
        in_free = block.block_id in bm.free
        assert in_free == (block.ref_count == 0), "a block is either free or in use, never both"
    for key, block_id in bm.cached.items():
        assert bm.blocks[block_id].key == key
    if bm.events is not None:
        # Replaying the published feed from the start gives exactly the keys the cache holds.
        replayed: set[int] = set()
        for e in bm.events.since(0).events:
            replayed = replayed | set(e.keys) if e.kind == "stored" else replayed - set(e.keys)
        assert replayed == set(bm.cached)


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 10_000)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 24))
def test_block_manager_invariants(ops, block_size, num_blocks):
    bm = BlockManager(num_blocks, block_size, events=KVEventLog("", block_size))
    live: list[Sequence] = []
    for i, (op, arg) in enumerate(ops):
        if op == "add":
            # Small alphabet so prefixes repeat and the prefix cache is exercised.
            tokens = [(arg >> k) % 3 for k in range(1 + arg % 12)]
            seq = Sequence(f"s{i}", tokens, SamplingParams(max_tokens=1))
            if bm.can_allocate(seq):
                bm.allocate(seq)
                seq.num_computed_tokens = len(seq)
                bm.register_full_blocks(seq)
                live.append(seq)
        elif op == "grow" and live:
            seq = live[arg % len(live)]
            seq.token_ids.append(arg % 3)
            if bm.can_grow(seq, len(seq)):
                bm.grow(seq, len(seq))
                seq.num_computed_tokens = len(seq)
                bm.register_full_blocks(seq)
            else:
                seq.token_ids.pop()
        elif op == "free" and live:
            bm.free_sequence(live.pop(arg % len(live)))
        check_invariants(bm, live)
    for seq in live:
        bm.free_sequence(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == num_blocks


def test_prefix_hit_reuses_blocks_and_counts():
    bm = BlockManager(16, 4)
    a = Sequence("a", list(range(10)), SamplingParams(max_tokens=1))
    bm.allocate(a)
    a.num_computed_tokens = 10
    bm.register_full_blocks(a)
    b = Sequence("b", list(range(8)) + [99, 98, 97], SamplingParams(max_tokens=1))
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_computed_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.free_sequence(a)
    bm.free_sequence(b)
    # Freed blocks keep their contents: a third request still hits them.
    c = Sequence("c", list(range(9)), SamplingParams(max_tokens=1))
    bm.allocate(c)
    assert c.num_computed_tokens == 8
    assert bm.hit_tokens == 16


def test_whole_prompt_cached_still_leaves_a_token_to_compute():
    bm = BlockManager(8, 4)
    a = Sequence("a", list(range(8)), SamplingParams(max_tokens=1))
    bm.allocate(a)
    a.num_computed_tokens = 8
    bm.register_full_blocks(a)
    b = Sequence("b", list(range(8)), SamplingParams(max_tokens=1))
    bm.allocate(b)
    assert b.num_computed_tokens == 4  # the last block is recomputed for its logits


def test_event_log_gives_a_snapshot_to_a_reader_too_far_behind_or_ahead():
    log = KVEventLog("m", 4, window=3)
    for k in range(5):
        log.stored([k])
    log.removed([0])
    recent = log.since(4)
    assert [e.seq for e in recent.events] == [5, 6] and not recent.reset
    behind = log.since(1)  # events 2.. are no longer all in the window
    assert behind.reset and set(behind.snapshot) == {1, 2, 3, 4} and behind.last_seq == 6
    assert log.since(99).reset  # a reader ahead of the log: the replica restarted
