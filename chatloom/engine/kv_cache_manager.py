"""Each sequence's blocks: its block table, grown, trimmed and freed, and its prompt's prefix found in the cache.

The manager is the only writer of a Sequence's `block_table`, `num_hashed_blocks` and, at allocation,
of its `num_computed_tokens` (what the cache already holds). It asks the block pool (block_pool.py)
for blocks and keys, and keeps the prefix-cache counters in tokens (vLLM's convention).

A prompt reuses every leading full block the cache holds, and also the leading tokens of a cached
block it agrees with only in part: every chat shares its template's first 24 tokens (system prompt
and all), one and a half blocks of 16, and the half is most of what a short question would recompute.
The new sequence then gets a fresh block and the cached block's first k slots are copied into it
(`copy_prefix`, the runner's; K and V of a token depend only on the tokens up to it, so they are the
ones a recomputation would write).

In a model whose every layer attends within a window (Mistral's and Phi-3's configs), a block whose
keys every later query is too far ahead to see is given back to the pool as the sequence moves on
(`release_behind_window`), so a long conversation holds about a window's blocks, not its length's.
Its table entry stays where it was, so positions still map to blocks; the windowed attention reads
only the blocks inside the window (models/attention.py), and masks anything else it gathers.
"""
from __future__ import annotations

from typing import Callable

from chatloom.engine.block_pool import BlockPool, NoFreeBlocks
from chatloom.engine.held_rounds import Held, HeldRounds, common_prefix
from chatloom.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool, copy_prefix: Callable[[int, int, int], None] | None = None,
                 window: int | None = None) -> None:
        self.pool = pool
        # The attention window every layer has (None: some layer sees the whole context).
        self.window = window
        self.released_blocks = 0  # given back behind the window, over the manager's life
        self.block_size = pool.block_size
        # copy_prefix(src, dst, n): copy the K/V of block src's first n slots into block dst. Without
        # it, only whole blocks are reused.
        self.copy_prefix = copy_prefix
        self.query_tokens = 0  # prompt tokens that could have come from the cache
        self.hit_tokens = 0  # those that did
        self._free = pool.free  # read on every decode's growth: one lookup less
        # Rounds kept while their tools run (kv_holds.py): a resume adopts its round's blocks.
        self.holds: HeldRounds | None = None

    # -- counts --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return self.pool.usage

    @property
    def evictions(self) -> int:
        return self.pool.evictions

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup ----------------------------------------------------------------
    def _cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids holding the longest cached run of full blocks at the start of token_ids."""
        hits: list[int] = []
        pool = self.pool
        if not pool.enable_caching:
            return hits
        bs, parent = self.block_size, pool.root_key
        # Leave at least one token to compute: its logits are needed.
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            key = pool.block_key(parent, tokens)
            block_id = pool.lookup(key, tokens)
            if block_id is None:
                break
            hits.append(block_id)
            parent = key
        return hits

    def _partial_hit(self, token_ids: list[int], num_hits: int, parent: int) -> tuple[int | None, int]:
        """A cached block after `parent` whose first k tokens are the next ones of token_ids, with k as
        large as the pool's index knows (and at least one token left to compute): (block id, k), or (None, 0)."""
        if self.copy_prefix is None or not self.pool.enable_caching:
            return None, 0
        start = num_hits * self.block_size
        want = tuple(token_ids[start:start + min(self.block_size - 1, len(token_ids) - 1 - start)])
        return self.pool.find_partial(parent, want)

    # -- block tables ------------------------------------------------------------------
    def _hits(self, seq: Sequence) -> list[int]:
        # A request for its prompt's log probabilities computes every prompt token: cached ones give no logits.
        return [] if seq.params.prompt_logprobs is not None else self._cached_prefix(seq.cache_token_ids)

    def can_allocate(self, seq: Sequence) -> bool:
        held = self._held_for(seq)
        if held is not None:
            _, keep, reuse, _, drop = self._adoption(seq, held)
            blocks = self.pool.blocks
            frees = sum(1 for b in drop if blocks[b].ref_count == 1)
            return self.blocks_needed(len(seq)) - len(keep) - (reuse is not None) <= self.num_free_blocks + frees
        hits = self._hits(seq)
        # Hit blocks sitting on the free list are not free for this purpose: we take them.
        blocks = self.pool.blocks
        hits_on_free = sum(1 for b in hits if blocks[b].ref_count == 0)
        need = self.blocks_needed(len(seq)) - len(hits)
        return need <= self.num_free_blocks - hits_on_free

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its current tokens: a resume's kept blocks, else cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        holds = self.holds if seq.params.resume_of is not None and not seq.resume_counted else None
        if holds is not None:
            seq.resume_counted = True
            held = holds.take(seq)
            if held is not None:
                self._adopt(seq, held)
                holds.resumed(seq, held.token_ids, seq.num_computed_tokens)
                return
            before = holds.forget_evicted(seq.params.resume_of)
        self._allocate(seq)
        if holds is not None:
            holds.resumed(seq, before, seq.num_computed_tokens)

    # -- a resume adopting its round's blocks ------------------------------------------------
    def _held_for(self, seq: Sequence) -> Held | None:
        if self.holds is None or seq.params.resume_of is None or seq.resume_counted:
            return None
        return self.holds.held.get(seq.params.resume_of)

    def _adoption(self, seq: Sequence, held: Held) -> tuple[int, list[int], int | None, int | None, list[int]]:
        """How `seq` takes `held`'s blocks: (tokens reused, full blocks kept, a partial block reused in place,
        a partial block to copy from, blocks given back). A partial block published in the prefix cache is
        copied, never written into (others may read it)."""
        bs, table, blocks = self.block_size, held.block_table, self.pool.blocks
        reused = min(common_prefix(held.token_ids, seq.cache_token_ids), len(seq) - 1)
        full, part = divmod(reused, bs)
        reuse = copy = None
        if part:
            block = blocks[table[full]]
            if block.key is None and block.ref_count == 1:
                reuse = table[full]
            elif self.copy_prefix is not None:
                copy = table[full]
            else:
                reused, part = full * bs, 0
        drop = [b for b in table[full:] if b != reuse]
        return reused, table[:full], reuse, copy, drop

    def _adopt(self, seq: Sequence, held: Held) -> None:
        reused, keep, reuse, copy, drop = self._adoption(seq, held)
        pool = self.pool
        seq.block_table = keep + ([reuse] if reuse is not None else [])
        if copy is not None:
            block = pool.get_new_block()
            self.copy_prefix(copy, block.block_id, reused % self.block_size)
            seq.block_table.append(block.block_id)
        pool.release(reversed(drop))
        try:
            for _ in range(self.blocks_needed(len(seq)) - len(seq.block_table)):
                seq.block_table.append(pool.get_new_block().block_id)
        except NoFreeBlocks:
            self.free_sequence(seq)
            raise
        self.query_tokens += len(seq) - 1
        self.hit_tokens += reused
        seq.num_computed_tokens = reused
        seq.num_hashed_blocks = min(held.num_hashed, len(keep))
        seq.metrics.num_cached_tokens = max(seq.metrics.num_cached_tokens, reused)

    def _allocate(self, seq: Sequence) -> None:
        pool = self.pool
        keyed = seq.cache_token_ids
        hits = self._hits(seq)
        parent = pool.blocks[hits[-1]].key if hits else pool.root_key
        donor, partial = (None, 0) if seq.params.prompt_logprobs is not None else \
            self._partial_hit(keyed, len(hits), parent)
        # Every token but the last could have come from the cache (its logits are needed).
        self.query_tokens += len(seq) - 1
        self.hit_tokens += len(hits) * self.block_size + partial
        for block_id in hits:
            pool.touch(block_id)
            seq.block_table.append(block_id)
        try:
            for i in range(self.blocks_needed(len(seq)) - len(hits)):
                block = pool.get_new_block()
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
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make room for `num_tokens` tokens in total (decode: one more)."""
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self.pool.get_new_block().block_id)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (speculative tokens that
        were rejected). Those blocks were never registered (registration stops at the
        computed tokens), so they go to the front of the free list, reused first."""
        keep = self.blocks_needed(num_tokens)
        table = seq.block_table
        if len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self.pool.release(reversed(tail), reuse_first=True)

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give `child` the K/V of `parent`'s computed tokens without computing them again: the full blocks
        shared (one more reference each), the partial last block copied into a fresh one, as each choice
        writes its own next token there. False (nothing taken) when no block is free for the copy."""
        bs, table = self.block_size, parent.block_table
        full, partial = divmod(parent.num_computed_tokens, bs)
        if partial and (not self._free or self.copy_prefix is None):
            return False
        for block_id in table[:full]:
            self.pool.touch(block_id)
        child.block_table = table[:full]
        if partial:
            block = self.pool.get_new_block()
            self.copy_prefix(table[full], block.block_id, partial)
            child.block_table.append(block.block_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        return True

    def register_full_blocks(self, seq: Sequence, computed: int | None = None) -> None:
        """Publish every computed, full block of `seq` in the prefix cache (of its first `computed`
        tokens when given: the simulator publishes what a run of steps had computed before its last)."""
        if not self.pool.enable_caching:
            return
        num_full = (seq.num_computed_tokens if computed is None else computed) // self.block_size
        if num_full > seq.num_hashed_blocks:
            self.pool.cache_full_blocks(seq.block_table, seq.cache_token_ids, seq.num_hashed_blocks, num_full)
            seq.num_hashed_blocks = num_full

    def release_behind_window(self, seq: Sequence) -> None:
        """Give back the leading blocks of `seq` that no later query can see: the next query is at
        position num_computed_tokens, and a query at p sees keys p - window + 1 .. p, so block i
        (positions i * bs .. i * bs + bs - 1) is done once i * bs + bs <= num_computed - window + 1.
        With prefix caching, the last published block stays: the next block's key is made from its own."""
        if self.window is None:
            return
        done = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size
        if self.pool.enable_caching:
            done = min(done, seq.num_hashed_blocks - 1)
        if done > seq.num_released_blocks:
            # Oldest first to the back of the free list: a published block stays findable by the
            # prefix cache until it is handed out again.
            self.pool.release(seq.block_table[seq.num_released_blocks:done])
            self.released_blocks += done - seq.num_released_blocks
            seq.num_released_blocks = done

    @property
    def held_blocks(self) -> int:
        """Blocks held by live sequences."""
        return self.num_blocks - self.num_free_blocks

    def free_sequence(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its tail blocks are evicted first."""
        self.pool.release(reversed(seq.block_table[seq.num_released_blocks:]))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.num_released_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no running sequence holds (between benchmark runs)."""
        self.pool.reset_prefix_cache()
