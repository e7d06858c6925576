"""Counting attempts per key in fixed windows: the brute-force limits on sign-in and sign-up.

`AttemptStore` counts; `MemoryAttempts` is the one-process store, and app/state/redis_attempts.py the
one gateways share through Redis (so an attacker gains nothing by spreading guesses over gateways)."""
from __future__ import annotations

import time
from typing import Callable, Protocol


class AttemptStore(Protocol):
    async def peek(self, key: str) -> tuple[int, float]:
        """(attempts counted in the key's current window, seconds until that window ends)."""

    async def add(self, key: str, window_s: float) -> int:
        """Count one attempt; a key's window starts at its first attempt. The count so far."""

    async def clear(self, key: str) -> None:
        ...


class MemoryAttempts:
    """Attempts in this process; expired windows are dropped as they are met."""

    MAX_KEYS = 100_000  # a bound on memory under a flood of distinct names

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._windows: dict[str, tuple[float, int]] = {}  # key -> (window end, count)

    async def peek(self, key: str) -> tuple[int, float]:
        entry = self._windows.get(key)
        now = self.clock()
        if entry is None or entry[0] <= now:
            return 0, 0.0
        return entry[1], entry[0] - now

    async def add(self, key: str, window_s: float) -> int:
        now = self.clock()
        end, count = self._windows.get(key, (0.0, 0))
        if end <= now:
            end, count = now + window_s, 0
        if key not in self._windows and len(self._windows) >= self.MAX_KEYS:
            self._windows = {k: v for k, v in self._windows.items() if v[0] > now}
            if len(self._windows) >= self.MAX_KEYS:  # still full: the oldest tenth goes
                for old in list(self._windows)[: self.MAX_KEYS // 10]:
                    del self._windows[old]
        self._windows[key] = (end, count + 1)
        return count + 1

    async def clear(self, key: str) -> None:
        self._windows.pop(key, None)
