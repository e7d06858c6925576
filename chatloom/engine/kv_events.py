"""The prefix cache's changes as a numbered log: which block keys were stored and which evicted.

A replica publishes this log so a router knows exactly which prompts' blocks it holds (vLLM publishes
KV events for the same reason). Every event has a sequence number; a reader asks for the events after
the last number it saw and so catches up after a reconnect. The log keeps a bounded window of recent
events and the current set of keys: a reader too far behind gets that set as a snapshot instead.
The engine thread writes, HTTP handlers read: one lock guards both.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterable

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: str  # stored | removed | cleared
    keys: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVEventBatch:
    """What a reader gets: events after its position, or (reset=True) a snapshot of every key."""

    events: list[KVEvent]
    last_seq: int  # the reader's next position
    reset: bool = False
    snapshot: tuple[int, ...] = ()


class KVEventLog:
    def __init__(self, model_key: str, block_size: int, window: int = 65536) -> None:
        self.model_key = model_key
        self.block_size = block_size
        self._events: deque[KVEvent] = deque(maxlen=window)
        self._keys: set[int] = set()
        self._seq = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    @property
    def last_seq(self) -> int:
        return self._seq

    def _append(self, kind: str, keys: tuple[int, ...]) -> None:
        with self._lock:
            self._seq += 1
            self._events.append(KVEvent(self._seq, kind, keys))
            if kind == STORED:
                self._keys.update(keys)
            elif kind == REMOVED:
                self._keys.difference_update(keys)
            else:
                self._keys.clear()
            self._changed.notify_all()

    def stored(self, keys: Iterable[int]) -> None:
        keys = tuple(keys)
        if keys:
            self._append(STORED, keys)

    def removed(self, keys: Iterable[int]) -> None:
        keys = tuple(keys)
        if keys:
            self._append(REMOVED, keys)

    def cleared(self) -> None:
        self._append(CLEARED, ())

    def since(self, after: int) -> KVEventBatch:
        """Events numbered above `after`; a snapshot when those are no longer all in the window
        (or when `after` is ahead of the log: the replica restarted)."""
        with self._lock:
            first = self._events[0].seq if self._events else self._seq + 1
            if after > self._seq or after < first - 1:
                return KVEventBatch([], self._seq, reset=True, snapshot=tuple(self._keys))
            return KVEventBatch([e for e in self._events if e.seq > after], self._seq)

    def wait(self, after: int, timeout: float) -> bool:
        """Block (a worker thread, not the event loop) until an event past `after` exists or timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._seq > after, timeout)
