"""The KV pool's blocks: their refcounts, their keys, and the free list that is the prefix cache.

The pool has a fixed number of blocks of `block_size` token slots each. A block is held by as many
sequences as its refcount says. A full block, once computed, gets a key: hash(parent key, its token
ids), rooted in the model id (block_hash.py, stable across processes), so identical prefixes map to
identical keys. A block whose count drops to zero keeps its contents and key on an LRU free list
until it is handed out again: that free list is the prefix cache, and handing a block out is what
evicts it. Every stored and evicted key is published in the replica's event log (kv_events.py).

For reuse of part of a block (kv_cache_manager.py), cached blocks are also found by their first j
tokens for every j < block_size (`find_partial`).

Which sequence holds which blocks is not the pool's business: KVCacheManager keeps the block tables.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator

from chatloom.engine import block_hash
from chatloom.engine.kv_events import KVEventLog


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: int | None = None  # set once the block is full and registered
    token_ids: tuple[int, ...] = ()
    parent: int | None = None  # the key of the block before it, once registered


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, model_key: str = "",
                 enable_caching: bool = True, events: KVEventLog | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.root_key = block_hash.root_key(model_key)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first). Values unused.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # key -> block id
        # hash((parent key, first j tokens)) -> a cached block starting so, for j < block_size. A hint:
        # what it names is checked before use.
        self._starts: dict[int, int] = {}
        self.evictions = 0
        self.handed_out = 0  # blocks taken off the free list, ever: how fast the prefix cache turns over
        self.events = events  # where stored and evicted keys are published (a replica's feed)

    # -- counts --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return 1.0 - len(self.free) / self.num_blocks

    def block_key(self, parent: int, tokens: tuple[int, ...]) -> int:
        return block_hash.block_key(parent, tokens)

    # -- handing blocks out and taking them back -------------------------------------
    def get_new_block(self) -> Block:
        """The free block first in eviction order, its cached contents (if any) evicted; refcount 1."""
        if not self.free:
            raise NoFreeBlocks()
        block_id, _ = self.free.popitem(last=False)
        self.handed_out += 1
        block = self.blocks[block_id]
        if block.key is not None:
            if self.cached.get(block.key) == block_id:
                del self.cached[block.key]
                self._unindex_starts(block)
                self.evictions += 1
                if self.events is not None:
                    self.events.removed((block.key,))
            block.key, block.token_ids, block.parent = None, (), None
        block.ref_count = 1
        return block

    def touch(self, block_id: int) -> None:
        """One more holder for a cached block (a prefix hit); off the free list if it was there."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def release(self, block_ids: Iterable[int], reuse_first: bool = False) -> None:
        """Drop one reference to each block, in the order given. A block nobody holds goes to the
        back of the free list with its contents; with `reuse_first`, one that holds no key (never
        registered, so useless to the cache) goes to the front instead."""
        blocks, free = self.blocks, self.free
        for block_id in block_ids:
            block = blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, "negative refcount"
            if block.ref_count == 0:
                free[block_id] = None
                if reuse_first and block.key is None:
                    free.move_to_end(block_id, last=False)

    # -- the prefix cache -------------------------------------------------------------
    def lookup(self, key: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block with `key` holding `tokens`, or None."""
        block_id = self.cached.get(key)
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    def cache_full_blocks(self, block_table: list[int], token_ids: list[int], start: int, end: int) -> None:
        """Give blocks start..end-1 of a block table (all full and computed) their keys and publish the
        new ones; blocks before `start` already have theirs."""
        bs, blocks = self.block_size, self.blocks
        parent = blocks[block_table[start - 1]].key if start else self.root_key
        new_keys: list[int] = []
        for i in range(start, end):
            block = blocks[block_table[i]]
            if block.key is None:
                tokens = tuple(token_ids[i * bs:(i + 1) * bs])
                block.key, block.token_ids, block.parent = self.block_key(parent, tokens), tokens, parent
                if self.cached.setdefault(block.key, block.block_id) == block.block_id:
                    new_keys.append(block.key)
                    self._index_starts(block)
            parent = block.key
        if new_keys and self.events is not None:
            self.events.stored(new_keys)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody holds."""
        dropped = [k for k, b in self.cached.items() if self.blocks[b].ref_count == 0]
        for block in self.blocks:
            if block.ref_count == 0:
                block.key, block.token_ids, block.parent = None, (), None
        self.cached = {k: b for k, b in self.cached.items() if self.blocks[b].ref_count > 0}
        self._starts = {}
        for block_id in self.cached.values():
            self._index_starts(self.blocks[block_id])
        if self.events is not None:
            self.events.removed(dropped)

    # -- cached blocks by their first tokens ---------------------------------------------
    def _start_hashes(self, parent: int, tokens: tuple[int, ...]) -> Iterator[tuple[int, int]]:
        for j in range(1, min(len(tokens), self.block_size - 1) + 1):
            yield j, hash((parent, tokens[:j]))

    def _index_starts(self, block: Block) -> None:
        for _, h in self._start_hashes(block.parent, block.token_ids):
            self._starts[h] = block.block_id

    def _unindex_starts(self, block: Block) -> None:
        for _, h in self._start_hashes(block.parent, block.token_ids):
            if self._starts.get(h) == block.block_id:
                del self._starts[h]

    def find_partial(self, parent: int, want: tuple[int, ...]) -> tuple[int | None, int]:
        """A cached block after `parent` whose first j tokens are want[:j], with j as large as the index
        knows: (block id, j), or (None, 0)."""
        for j, h in reversed(list(self._start_hashes(parent, want))):
            block_id = self._starts.get(h)
            if block_id is None:
                continue
            block = self.blocks[block_id]
            if (block.parent == parent and block.token_ids[:j] == want[:j]
                    and block.key is not None and self.cached.get(block.key) == block_id):
                return block_id, j
        return None, 0
