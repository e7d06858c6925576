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

A piece whose encoder layers run in slices across steps (encoder_plan.py) leaves its hidden state here
between slices (`put_partial`), with the number of layers done. That state counts in `bytes` like any
entry, is kept only while the piece is pinned (never evicted), is not readable as embeddings, and is
dropped when the piece's last pin goes (its requests finished, aborted or preempted) or when the
finished embeddings replace it.
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
        # Pieces part-way through the encoder: their hidden state and how many layers it has been through.
        self._partial: dict[PieceKey, tuple[torch.Tensor, int]] = {}
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

    @property
    def partial_count(self) -> int:
        return len(self._partial)

    def layers_done(self, key: PieceKey) -> int:
        """Encoder layers a piece part-way through the encoder has been through (0: none kept)."""
        found = self._partial.get(key)
        return found[1] if found is not None else 0

    def partial(self, key: PieceKey) -> torch.Tensor | None:
        found = self._partial.get(key)
        return found[0] if found is not None else None

    def partial_bytes(self, key: PieceKey) -> int:
        found = self._partial.get(key)
        return _nbytes(found[0]) if found is not None else 0

    def put_partial(self, key: PieceKey, hidden: torch.Tensor, layers: int) -> None:
        """Keep a piece's hidden state after `layers` encoder layers, in place of any earlier one; only
        while the piece is pinned (nobody would continue it otherwise)."""
        if key not in self._pins or key in self._entries:
            return
        self._drop_partial(key)
        size = _nbytes(hidden)
        self._partial[key] = (hidden, layers)
        self.bytes += size
        self.pinned_bytes += size
        self._evict_to(self.max_bytes)

    def _drop_partial(self, key: PieceKey) -> None:
        found = self._partial.pop(key, None)
        if found is not None:
            size = _nbytes(found[0])
            self.bytes -= size
            self.pinned_bytes -= size

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
            self._drop_partial(key)  # nobody will continue it: its requests are done or gone
            self._evict_to(self.max_bytes)  # an over-limit piece leaves as soon as it is read

    def put(self, key: PieceKey, embeddings: torch.Tensor) -> None:
        self._drop_partial(key)
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
        """Drop every unpinned entry (partial states are all pinned)."""
        self._evict_to(0)
