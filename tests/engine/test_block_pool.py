"""The block pool: refcounts, the free list that is the prefix cache, block keys and their events."""
from __future__ import annotations

from chatloom.engine import block_hash
from chatloom.engine.block_pool import BlockPool
from chatloom.engine.kv_events import KVEventLog


def _replayed(events: KVEventLog) -> set[int]:
    keys: set[int] = set()
    for e in events.since(0).events:
        keys = keys | set(e.keys) if e.kind == "stored" else keys - set(e.keys)
    return keys


def test_cached_keys_are_the_ones_a_router_computes():
    tokens = list(range(100, 111))  # two full blocks and three tokens
    want = block_hash.prefix_block_keys(tokens, 4, "m")
    # In one call, and block by block (the second chaining onto the first's key): the same keys.
    at_once = BlockPool(8, 4, "m")
    table = [at_once.get_new_block().block_id for _ in range(3)]
    at_once.cache_full_blocks(table, tokens, 0, 2)
    assert [at_once.blocks[b].key for b in table[:2]] == want
    events = KVEventLog("m", 4)
    pool = BlockPool(8, 4, "m", events=events)
    table = [pool.get_new_block().block_id for _ in range(3)]
    pool.cache_full_blocks(table, tokens, 0, 1)
    pool.cache_full_blocks(table, tokens, 1, 2)
    assert [pool.blocks[b].key for b in table[:2]] == want
    assert pool.blocks[table[2]].key is None  # not full: never keyed
    assert set(pool.cached) == set(want) == _replayed(events)
    assert pool.lookup(want[0], tuple(tokens[:4])) == table[0]
    assert pool.lookup(want[0], tuple(tokens[1:5])) is None  # a key is checked against its tokens


def test_a_freed_block_stays_cached_until_handed_out_least_recently_freed_first():
    events = KVEventLog("", 2)
    pool = BlockPool(3, 2, events=events)
    a, b = pool.get_new_block().block_id, pool.get_new_block().block_id
    pool.cache_full_blocks([a, b], [1, 2, 3, 4], 0, 2)
    key_a, key_b = pool.blocks[a].key, pool.blocks[b].key
    pool.release([b, a])  # b freed first: evicted first among the two
    assert pool.num_free_blocks == 3 and pool.usage == 0.0
    assert pool.lookup(key_a, (1, 2)) == a and pool.lookup(key_b, (3, 4)) == b
    third = pool.get_new_block()  # never used: goes before either cached block
    assert third.block_id not in (a, b) and pool.evictions == 0
    assert pool.get_new_block().block_id == b
    assert pool.evictions == 1 and key_b not in pool.cached and _replayed(events) == {key_a}
    pool.touch(a)  # a prefix hit takes the cached block off the free list
    assert pool.num_free_blocks == 0 and pool.blocks[a].ref_count == 1 and key_a in pool.cached


def test_released_blocks_without_a_key_are_reused_first_when_asked():
    pool = BlockPool(4, 2)
    ids = [pool.get_new_block().block_id for _ in range(4)]
    pool.cache_full_blocks(ids, [5, 6, 7, 8, 9, 10, 11, 12], 0, 2)  # the first two hold keys
    pool.release([ids[0]])
    pool.release([ids[3], ids[1], ids[2]], reuse_first=True)
    # Unkeyed blocks jump the queue (the last released first); keyed ones wait at the back.
    assert list(pool.free) == [ids[2], ids[3], ids[0], ids[1]]


def test_shared_blocks_return_to_the_free_list_with_their_last_holder():
    pool = BlockPool(2, 2)
    block = pool.get_new_block().block_id
    pool.touch(block)
    pool.release([block])
    assert block not in pool.free and pool.blocks[block].ref_count == 1
    pool.release([block])
    assert block in pool.free and pool.blocks[block].ref_count == 0


def test_reset_forgets_only_the_blocks_nobody_holds():
    events = KVEventLog("", 2)
    pool = BlockPool(4, 2, events=events)
    held, idle = pool.get_new_block().block_id, pool.get_new_block().block_id
    pool.cache_full_blocks([held], [1, 2], 0, 1)
    pool.cache_full_blocks([idle], [3, 4], 0, 1)
    pool.release([idle])
    pool.reset_prefix_cache()
    assert set(pool.cached) == {pool.blocks[held].key} == _replayed(events)
    assert pool.blocks[idle].key is None
    assert pool.find_partial(pool.root_key, (1,)) == (held, 1)  # the start index is rebuilt for what stays
    assert pool.find_partial(pool.root_key, (3,)) == (None, 0)
