"""Image embeddings by (content hash, piece), so a second question about the same image runs no encoder.

An LRU map under a byte limit. An image's encoder work comes in pieces (an Idefics3 tile, a whole LLaVA
image: engine/encoder_plan.py), each kept here as it is encoded, and a later prompt with the same image
(the same bytes) takes them from here.

Pins keep a piece until the prefill that needs it has read it: the planner pins every piece a
sequence's chunk reaches (already here, or planned for this step) and unpins it once the sequence's
computed tokens are past it. A pinned piece is never evicted, and the planner encodes a new piece only
while pinned pieces and that one fit the limit, so the limit holds for everything kept. The one
exception is a piece larger than the whole limit: it is encoded only when nothing else is pinned, kept
while pinned, and dropped as soon as its prefill has read it.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

import torch

PieceKey = tuple[str, int]  # (image content hash, piece index)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[PieceKey, torch.Tensor] = OrderedDict()
        self._pins: Counter[PieceKey] = Counter()
        self.bytes = 0
        self.pinned_bytes = 0  # of the pinned entries present
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __contains__(self, key: PieceKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: PieceKey) -> torch.Tensor | None:
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return found

    def pin(self, key: PieceKey) -> None:
        """Keep `key` (present now or put later) until as many unpins."""
        self._pins[key] += 1
        if self._pins[key] == 1 and key in self._entries:
            self.pinned_bytes += _nbytes(self._entries[key])

    def unpin(self, key: PieceKey) -> None:
        if self._pins[key] <= 0:
            raise KeyError(f"{key} is not pinned")
        self._pins[key] -= 1
        if self._pins[key] == 0:
            del self._pins[key]
            if key in self._entries:
                self.pinned_bytes -= _nbytes(self._entries[key])
            self._evict_to(self.max_bytes)  # an over-limit piece leaves as soon as it is read

    def put(self, key: PieceKey, embeddings: torch.Tensor) -> None:
        if key in self._entries:
            return
        size = _nbytes(embeddings)
        pinned = key in self._pins
        if not pinned and self.pinned_bytes + size > self.max_bytes:
            return  # no room beside the pinned pieces: not kept, nothing evicted for it
        self._evict_to(self.max_bytes - size)
        self._entries[key] = embeddings
        self.bytes += size
        if pinned:
            self.pinned_bytes += size

    def _evict_to(self, limit: int) -> None:
        """Evict unpinned entries, least recently used first, until at most `limit` bytes are kept."""
        if self.bytes <= limit:
            return
        for key in [k for k in self._entries if k not in self._pins]:
            if self.bytes <= limit:
                break
            self.bytes -= _nbytes(self._entries.pop(key))
            self.evictions += 1

    def clear(self) -> None:
        """Drop every unpinned entry."""
        self._evict_to(0)
