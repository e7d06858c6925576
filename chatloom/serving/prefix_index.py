"""What each replica's prefix cache holds, as the router knows it: a set of block keys per replica.

Block keys chain (a key hashes its parent key, engine/block_hash.py), so "the prompt's first n blocks
are cached" is "its first n keys are in the set": a set does the work of a radix tree. Two sources fill
an index: a replica's own event feed (exact: stored and evicted keys as the engine reports them) or,
for engines without a feed such as vLLM, the router's record of the prompts it sent there
(approximate: an LRU of bounded size standing in for the replica's own eviction). Pure data, no I/O.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class PrefixIndex:
    """Block keys one replica holds. `capacity` bounds an approximate index (None: unbounded, exact)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def matched(self, block_keys: Sequence[int]) -> int:
        """How many of `block_keys`, from the first, this replica holds."""
        n = 0
        for key in block_keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def add(self, keys: Sequence[int]) -> None:
        """Record a prompt's keys (in prompt order). The first keys end up most recent, as in the
        engine, which frees a sequence's tail blocks first: evicting the root side would void the rest."""
        for key in reversed(keys):
            self._keys[key] = None
            self._keys.move_to_end(key)
        if self.capacity is not None:
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def touch(self, keys: Sequence[int]) -> None:
        """Mark keys as recently used (an approximate index's LRU follows the replica's)."""
        for key in reversed(keys):
            if key in self._keys:
                self._keys.move_to_end(key)

    def remove(self, keys: Iterable[int]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def replace(self, keys: Iterable[int]) -> None:
        """Start over from a snapshot."""
        self._keys = OrderedDict((k, None) for k in keys)

    def clear(self) -> None:
        self._keys.clear()
