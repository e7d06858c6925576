"""Resident memory and open file descriptors of every process of the run, sampled from /proc.

A sample covers a process and its descendants (PostgreSQL's backends, a server's helpers). A slot
(gateway1, replica2, redis, ...) may be several processes over the run, one per start: growth is
judged per incarnation, between the first and the last quarter of its samples, for incarnations that
lived through at least `min_share` of the traffic window (a process restarted near the end has too
few samples to say anything).
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from chatloom.bench.server_process import _children, tree_rss_bytes


def tree_fds(pid: int) -> int:
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass
        todo.extend(_children(p))
    return total


@dataclass
class Samples:
    slot: str
    pid: int
    times: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)


class Sampler:
    """Samples every slot's current process every `every_s` seconds until stopped."""

    def __init__(self, slots: dict[str, Callable[[], int | None]], every_s: float = 2.0) -> None:
        self.slots = slots
        self.every_s = every_s
        self.incarnations: list[Samples] = []
        self._current: dict[str, Samples] = {}

    def sample(self) -> None:
        now = time.monotonic()
        for slot, pid_of in self.slots.items():
            pid = pid_of()
            if pid is None or not Path(f"/proc/{pid}").exists():
                continue
            s = self._current.get(slot)
            if s is None or s.pid != pid:
                s = self._current[slot] = Samples(slot, pid)
                self.incarnations.append(s)
            rss = tree_rss_bytes(pid)
            if rss:
                s.times.append(now)
                s.rss.append(rss)
                s.fds.append(tree_fds(pid))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.sample)
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
            except asyncio.TimeoutError:
                pass


def growth(samples: Samples) -> dict:
    """Mean of the last quarter over the mean of the first quarter, for RSS and fds."""
    n = max(1, len(samples.rss) // 4)

    def ratio(xs: list[int]) -> float:
        first, last = sum(xs[:n]) / n, sum(xs[-n:]) / n
        return round(last / first - 1.0, 4) if first else 0.0

    return {"slot": samples.slot, "pid": samples.pid, "samples": len(samples.rss),
            "lived_s": round(samples.times[-1] - samples.times[0], 1) if samples.times else 0.0,
            "rss_first_mib": round(sum(samples.rss[:n]) / n / 2**20, 1),
            "rss_last_mib": round(sum(samples.rss[-n:]) / n / 2**20, 1),
            "rss_growth": ratio(samples.rss), "fds_first": round(sum(samples.fds[:n]) / n, 1),
            "fds_last": round(sum(samples.fds[-n:]) / n, 1), "fds_growth": ratio(samples.fds),
            "series": _series(samples)}


def _series(samples: Samples, points: int = 24) -> list[list[float]]:
    """[seconds since the incarnation's first sample, RSS MiB, fds], at most `points` of them."""
    step = max(1, len(samples.rss) // points)
    t0 = samples.times[0] if samples.times else 0.0
    return [[round(samples.times[i] - t0, 1), round(samples.rss[i] / 2**20, 1), samples.fds[i]]
            for i in range(0, len(samples.rss), step)]
