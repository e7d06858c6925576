"""The KV pool's bookkeeping: block tables, refcounts and the automatic prefix cache.

A full block's key is hash(parent key, its token ids), rooted in the model id (block_hash.py,
stable across processes), so identical prefixes map to identical keys. Blocks are refcounted; a block whose
count drops to zero keeps its contents and key on an LRU free list until it is
handed out again: that free list is the prefix cache.

A prompt also reuses the leading tokens of a cached block when it agrees with only part of it: every
chat shares its template's first 24 tokens (system prompt and all), one and a half blocks of 16, and
the half is most of what a short question would recompute. The new sequence gets a fresh block and
the cached block's first k slots are copied into it (`copy_prefix`, the runner's; K and V of a token
depend only on the tokens up to it, so they are the ones a recomputation would write). Cached blocks
are found by their first j tokens for every j (`_starts`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from chatloom.engine import block_hash
from chatloom.engine.kv_events import KVEventLog
from chatloom.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: int | None = None  # set once the block is full and registered
    token_ids: tuple[int, ...] = ()
    parent: int | None = None  # the key of the block before it, once registered


class NoFreeBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, model_key: str = "",
                 enable_prefix_caching: bool = True, events: KVEventLog | None = None,
                 copy_prefix: Callable[[int, int, int], None] | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_key = block_hash.root_key(model_key)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first). Values unused.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # key -> block id
        # copy_prefix(src, dst, n): copy the K/V of block src's first n slots into block dst. Without
        # it, only whole blocks are reused.
        self.copy_prefix = copy_prefix
        # hash((parent key, first j tokens)) -> a cached block starting so, for j < block_size. A hint:
        # what it names is checked before use.
        self._starts: dict[int, int] = {}
        # Prefix-cache counters, in tokens (vLLM's convention).
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        self.events = events  # where stored and evicted keys are published (a replica's feed)

    # -- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_key(self, parent: int, tokens: tuple[int, ...]) -> int:
        return block_hash.block_key(parent, tokens)

    # -- allocation ------------------------------------------------------------
    def _take_free_block(self) -> Block:
        if not self.free:
            raise NoFreeBlocks()
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:  # evict its cached contents
            if self.cached.get(block.key) == block_id:
                del self.cached[block.key]
                self._unindex_starts(block)
                self.evictions += 1
                if self.events is not None:
                    self.events.removed((block.key,))
            block.key, block.token_ids, block.parent = None, (), None
        block.ref_count = 1
        return block

    def _cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids holding the longest cached run of full blocks at the start of token_ids."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        bs, parent = self.block_size, self.root_key
        # Leave at least one token to compute: its logits are needed.
        num_full = (len(token_ids) - 1) // bs
        for i in range(num_full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            key = self.block_key(parent, tokens)
            block_id = self.cached.get(key)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = key
        return hits

    # -- reusing part of a cached block ------------------------------------------
    def _start_hashes(self, parent: int, tokens: tuple[int, ...]):
        for j in range(1, min(len(tokens), self.block_size - 1) + 1):
            yield j, hash((parent, tokens[:j]))

    def _index_starts(self, block: Block) -> None:
        for _, h in self._start_hashes(block.parent, block.token_ids):
            self._starts[h] = block.block_id

    def _unindex_starts(self, block: Block) -> None:
        for _, h in self._start_hashes(block.parent, block.token_ids):
            if self._starts.get(h) == block.block_id:
                del self._starts[h]

    def _partial_hit(self, token_ids: list[int], num_hits: int, parent: int) -> tuple[int | None, int]:
        """A cached block after `parent` whose first k tokens are the next ones of token_ids, with k as
        large as the index knows (and at least one token left to compute): (block id, k), or (None, 0)."""
        if self.copy_prefix is None or not self.enable_prefix_caching:
            return None, 0
        start = num_hits * self.block_size
        want = tuple(token_ids[start:start + min(self.block_size - 1, len(token_ids) - 1 - start)])
        for j, h in reversed(list(self._start_hashes(parent, want))):
            block_id = self._starts.get(h)
            if block_id is None:
                continue
            block = self.blocks[block_id]
            if (block.parent == parent and block.token_ids[:j] == want[:j]
                    and block.key is not None and self.cached.get(block.key) == block_id):
                return block_id, j
        return None, 0

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq.token_ids)
        # Hit blocks sitting on the free list are not free for this purpose: we take them.
        hits_on_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        need = self.blocks_needed(len(seq)) - len(hits)
        return need <= self.num_free_blocks - hits_on_free

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its current tokens, reusing cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._cached_prefix(seq.token_ids)
        parent = self.blocks[hits[-1]].key if hits else self.root_key
        donor, partial = self._partial_hit(seq.token_ids, len(hits), parent)
        # Every token but the last could have come from the cache (its logits are needed).
        self.query_tokens += len(seq) - 1
        self.hit_tokens += len(hits) * self.block_size + partial
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        try:
            for i in range(self.blocks_needed(len(seq)) - len(hits)):
                block = self._take_free_block()
                seq.block_table.append(block.block_id)
                if i == 0 and partial and block.block_id != donor:
                    # Copied before any other block is taken: until then the donor keeps its contents
                    # even if it sits on the free list (when it is this very block, they are in place).
                    self.copy_prefix(donor, block.block_id, partial)
        except NoFreeBlocks:
            self.free_sequence(seq)
            raise
        seq.num_computed_tokens = len(hits) * self.block_size + partial
        seq.num_hashed_blocks = len(hits)
        seq.metrics.num_cached_tokens = max(seq.metrics.num_cached_tokens, seq.num_computed_tokens)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make room for `num_tokens` tokens in total (decode: one more)."""
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block().block_id)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (speculative tokens that
        were rejected). Those blocks were never registered (registration stops at the
        computed tokens), so they go to the front of the free list, reused first."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            assert block.ref_count >= 0, "negative refcount"
            if block.ref_count == 0:
                self.free[block.block_id] = None
                if block.key is None:
                    self.free.move_to_end(block.block_id, last=False)

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish every computed, full block of `seq` in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].key if seq.num_hashed_blocks else self.root_key
        new_keys: list[int] = []
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // bs):
            block = self.blocks[seq.block_table[i]]
            if block.key is None:
                tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                block.key, block.token_ids, block.parent = self.block_key(parent, tokens), tokens, parent
                if self.cached.setdefault(block.key, block.block_id) == block.block_id:
                    new_keys.append(block.key)
                    self._index_starts(block)
            parent = block.key
            seq.num_hashed_blocks = i + 1
        if new_keys and self.events is not None:
            self.events.stored(new_keys)

    def free_sequence(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its tail blocks are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, "negative refcount"
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> None:
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

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
