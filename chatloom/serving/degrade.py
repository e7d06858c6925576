"""Degrade before refusing: a ladder of cheaper answers taken one step at a time as load rises.

The decision logic only (which step is in force, from the signals); it lives in the serving room so
the fleet simulator runs the same ladder as the app, which applies the steps to requests
(app/traffic/control.py) and re-exports these names from app/traffic/degrade.py.

Two signals say how loaded the service is: how long requests wait in the admission queue (the oldest
waiting now, or the longest admitted in the last few seconds) and how full the KV cache is. Each step
has a threshold on each (the wait as a share of traffic.queue_max_wait_s); crossing either takes the
step, after every step below it, one step a reading:

1. `effort`: reasoning effort is capped (default: low), so thinking answers hold their slots shorter;
2. `small_model`: the chosen tiers (default: free) are answered by a smaller configured model;
3. `max_tokens`: the chosen tiers' answers are capped shorter.

Only after these does the admission queue refuse (503, or 529 on the Anthropic API), as it always
has when its wait would pass traffic.queue_max_wait_s. A request the queue would refuse at once while a
step is left takes that step instead (`step_up`) and waits its turn, so a burst that arrives all at once,
faster than the readings see anyone wait, still meets every step before the first refusal. A step is undone once both signals have stayed
below its thresholds' clearing levels (a share of the wait threshold, a margin under the KV one) for
`hold_s`, one step at a time, so the ladder does not flap around a threshold. The app reads the signals
each request and every `check_interval_s` besides, so the steps come off when the load has gone even if
no request comes. Which steps applied to a request is in its `x-chatloom-degraded` header, and the level
is on /metrics.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from chatloom.settings.tree import DegradeSettings

STEPS = ("effort", "small_model", "max_tokens")


@dataclass(frozen=True)
class Signals:
    queue_wait_s: float
    kv_usage: float  # 0..1; 0 where the backend does not tell


class RecentMax:
    """The largest value seen in the last `window_s` seconds."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._items: deque[tuple[float, float]] = deque()

    def add(self, value: float) -> None:
        now = self.clock()
        while self._items and self._items[-1][1] <= value:  # a smaller, older value can never be the max
            self._items.pop()
        self._items.append((now, value))

    def value(self) -> float:
        now = self.clock()
        while self._items and self._items[0][0] <= now - self.window_s:
            self._items.popleft()
        return self._items[0][1] if self._items else 0.0


class DegradeLadder:
    def __init__(self, settings: DegradeSettings, max_wait_s: float, signals: Callable[[], Signals],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.signals = signals
        self.clock = clock
        self.level = 0
        self._calm_since: float | None = None
        self._checked = float("-inf")
        s = settings
        # Wait thresholds are shares of the queue's own limit, so every step comes before it refuses.
        self._waits = tuple(max_wait_s * share for share in
                            (s.effort_queue_wait_share, s.small_model_queue_wait_share, s.max_tokens_queue_wait_share))
        self._kvs = (s.effort_kv_usage, s.small_model_kv_usage, s.max_tokens_kv_usage)

    def _crossed(self, step: int, sig: Signals) -> bool:
        return sig.queue_wait_s >= self._waits[step] or sig.kv_usage >= self._kvs[step]

    def _calm(self, step: int, sig: Signals) -> bool:
        s = self.settings
        return (sig.queue_wait_s < self._waits[step] * s.clear_queue_wait_share
                and sig.kv_usage < self._kvs[step] - s.clear_kv_margin)

    def update(self) -> int:
        """Read the signals (at most every `check_interval_s`) and move the ladder; the level now."""
        if not self.settings.enabled:
            return 0
        now = self.clock()
        if now - self._checked < self.settings.check_interval_s:
            return self.level
        self._checked = now
        sig = self.signals()
        target = max((i + 1 for i in range(len(STEPS)) if self._crossed(i, sig)), default=0)
        if target >= self.level:
            # Up one step a reading, so each step is in force (and on /metrics) for at least one check
            # interval before the next: the requests read in between get that step alone, even when the
            # signal leapt past two thresholds at once (a gateway stalled on a busy machine).
            if target > self.level:
                self.level += 1
            self._calm_since = None
        elif self._calm(self.level - 1, sig):
            if self._calm_since is None:
                self._calm_since = now
            elif now - self._calm_since >= self.settings.hold_s:
                self.level -= 1
                self._calm_since = now if self.level else None
        else:
            self._calm_since = None
        return self.level

    def step_up(self) -> bool:
        """Take the next step now, outside the readings (the admission queue is about to refuse a request
        at once: a burst came faster than the readings see waits); False when every step is taken."""
        if not self.settings.enabled or self.level >= len(STEPS):
            return False
        self.level += 1
        self._calm_since = None
        self._checked = self.clock()  # the next reading comes an interval later
        return True

    def active(self, step: str) -> bool:
        return self.level > STEPS.index(step)
