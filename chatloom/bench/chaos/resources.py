"""Resident memory and open file descriptors of every process of the run, sampled from /proc.

A slot (gateway1, replica2, redis, postgres) is one role, whichever process fills it: the faults kill
and restart them. A sample counts once its process has been serving for `warm_s` (a restarted gateway
climbs from 20 MiB to 480 MiB while it imports and loads, which is start-up, not growth). Growth is
the median of a slot's counted samples in the last quarter of the traffic window over the median in
the first quarter: a leak inside a process shows, and so does one that survives restarts.

Gateways and replicas are measured with their children, every descriptor counted (a leaked socket
is a leak). For Redis and PostgreSQL the main process alone, and no sockets: their backends and
client connections follow the gateways' connection pools, which fill and empty with the load.
"""
from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from chatloom.bench.server_process import _children, _status_kib, tree_rss_bytes


@dataclass(frozen=True)
class Slot:
    pid: Callable[[], int | None]
    ready_at: Callable[[], float | None]  # when the current process started serving (monotonic)
    service: bool = False  # Redis, PostgreSQL: main process only, sockets left out


@dataclass
class Sample:
    t: float
    pid: int
    rss: int
    fds: int
    sockets: int = 0  # of fds: sockets (connections of its pools and clients, which follow the load)


@dataclass
class SlotSamples:
    slot: str
    samples: list[Sample] = field(default_factory=list)


def _fds(pid: int) -> tuple[int, int]:
    """(descriptors, of which sockets)."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0, 0
    sockets = 0
    for name in names:
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:")
        except OSError:
            pass
    return len(names), sockets


def tree_fds(pid: int) -> tuple[int, int]:
    total = sockets = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        n, s = _fds(p)
        total, sockets = total + n, sockets + s
        todo.extend(_children(p))
    return total, sockets


class Sampler:
    """Samples every slot's current process every `every_s` seconds until stopped."""

    def __init__(self, slots: dict[str, Slot], every_s: float = 2.0, warm_s: float = 15.0) -> None:
        self.slots = slots
        self.every_s = every_s
        self.warm_s = warm_s
        self.series = {name: SlotSamples(name) for name in slots}

    def sample(self) -> None:
        now = time.monotonic()
        for name, slot in self.slots.items():
            pid, ready = slot.pid(), slot.ready_at()
            if pid is None or ready is None or now - ready < self.warm_s or not Path(f"/proc/{pid}").exists():
                continue
            rss = _status_kib(pid, "VmRSS") * 1024 if slot.service else tree_rss_bytes(pid)
            if slot.service:
                n, sockets = _fds(pid)
                fds, sockets = n - sockets, 0
            else:
                fds, sockets = tree_fds(pid)
            if rss:
                self.series[name].samples.append(Sample(now, pid, rss, fds, sockets))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.sample)
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
            except asyncio.TimeoutError:
                pass


def growth(series: SlotSamples, t0: float, window_s: float, min_samples: int = 3) -> dict:
    """The slot's medians in the first and last quarter of the window, and the growth between them
    (None where a quarter has fewer than `min_samples` counted samples)."""
    q = window_s / 4
    first = [s for s in series.samples if t0 <= s.t < t0 + q]
    last = [s for s in series.samples if t0 + window_s - q <= s.t <= t0 + window_s]
    out = {"slot": series.slot, "processes": len({s.pid for s in series.samples}),
           "samples_first": len(first), "samples_last": len(last)}
    if len(first) < min_samples or len(last) < min_samples:
        return {**out, "rss_growth": None, "fds_growth": None}
    rss0, rss1 = statistics.median(s.rss for s in first), statistics.median(s.rss for s in last)
    fds0, fds1 = statistics.median(s.fds for s in first), statistics.median(s.fds for s in last)
    return {**out, "rss_first_mib": round(rss0 / 2**20, 1), "rss_last_mib": round(rss1 / 2**20, 1),
            "rss_growth": round(rss1 / rss0 - 1, 4), "fds_first": fds0, "fds_last": fds1,
            "fds_growth": round(fds1 / fds0 - 1, 4) if fds0 else 0.0,
            "sockets_first": statistics.median(s.sockets for s in first),
            "sockets_last": statistics.median(s.sockets for s in last)}
