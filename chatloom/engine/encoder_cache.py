"""Image embeddings by content hash, so a second question about the same image runs no encoder.

An LRU map under a byte limit: the encoder's output for an image is kept after its prefill, and a
later prompt with the same image (the same bytes) takes it from here. An output larger than the
whole limit is used once and not kept.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, content_hash: str) -> torch.Tensor | None:
        found = self._entries.get(content_hash)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(content_hash)
        self.hits += 1
        return found

    def put(self, content_hash: str, embeddings: torch.Tensor) -> None:
        size = embeddings.numel() * embeddings.element_size()
        if size > self.max_bytes or content_hash in self._entries:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
            self.evictions += 1
        self._entries[content_hash] = embeddings
        self.bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
