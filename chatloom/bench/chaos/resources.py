"""Resident memory and open file descriptors of every process of the run, sampled from /proc.

A slot (gateway1, replica2, redis, postgres) is one role, whichever process fills it: the faults kill
and restart them. A sample counts once its process has been serving for `warm_s` (a restarted gateway
climbs from 20 MiB to 480 MiB while it imports and loads, which is start-up, not growth). Growth is
the median of a slot's counted samples in the last quarter of the traffic window over the median in
the first quarter: a leak inside a process shows, and so does one that survives restarts.

Gateways and replicas are measured with their children. Their descriptors' growth is judged with
the live connections (TCP established or listening, Unix sockets connected or listening) kept at
their first quarter's count: how many of those a gateway holds follows the load and its pools'
sizes, which a short run does not fill the same way in its first and last quarters. A leaked
connection is still judged: every peer of a gateway or replica (replicas, Redis, PostgreSQL, the
clients) is restarted or cut during the run, and a socket its peer closed that the process never
closed stays in CLOSE_WAIT, no longer live. For Redis and
PostgreSQL the main process alone, and no sockets: their backends and client connections follow the
gateways' connection pools, which fill and empty with the load.
"""
from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import Counter
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
    sockets: int = 0  # of fds: sockets
    live: int = 0  # of sockets: live connections (their number follows the load), left out of `held`
    held_kinds: dict[str, int] = field(default_factory=dict)  # what the held descriptors are, for the report

    @property
    def held(self) -> int:
        """The descriptors judged: files, pipes, and sockets no longer live."""
        return self.fds - self.live


@dataclass
class SlotSamples:
    slot: str
    samples: list[Sample] = field(default_factory=list)


_TCP_STATES = {"01": "established", "02": "syn_sent", "03": "syn_recv", "04": "fin_wait1", "05": "fin_wait2",
               "06": "time_wait", "07": "close", "08": "close_wait", "09": "last_ack", "0A": "listen",
               "0B": "closing"}
LIVE_STATES = {"tcp:established", "tcp:listen", "unix:connected", "unix:listening"}


def socket_states(pid: int) -> dict[str, str]:
    """Each socket inode in `pid`'s network namespace and its state ("tcp:close_wait", "unix:connected")."""
    states: dict[str, str] = {}
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9:
                states[cols[9]] = "udp" if table.startswith("udp") else "tcp:" + _TCP_STATES.get(cols[3], cols[3])
    try:
        lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
    except OSError:
        lines = []
    for line in lines:
        cols = line.split()  # Num RefCount Protocol Flags Type St Inode [Path]; flag 00010000: listening
        if len(cols) > 6:
            states[cols[6]] = ("unix:listening" if cols[3] == "00010000" else
                               "unix:connected" if cols[5] == "03" else "unix:unconnected")
    return states


def _kind(target: str, states: dict[str, str]) -> str:
    """A descriptor's kind: a socket's state, or what it points at (file, pipe, anon_inode:[eventfd])."""
    if target.startswith("socket:["):
        return states.get(target[8:-1], "socket:unknown")
    if target.startswith("/"):
        return "file"
    return target.split(":[", 1)[0] if target.startswith("pipe:") else target


def _fds(pid: int, states: dict[str, str], held: Counter) -> tuple[int, int, int]:
    """(descriptors, of which sockets, of which live); the held ones' kinds counted into `held`."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0, 0, 0
    sockets = alive = 0
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        kind = _kind(target, states)
        sockets += target.startswith("socket:[")
        if kind in LIVE_STATES:
            alive += 1
        else:
            held[kind] += 1
    return len(names), sockets, alive


def tree_fds(pid: int) -> tuple[int, int, int, dict[str, int]]:
    """(descriptors, sockets, live sockets, the held ones by kind) of `pid` and its children."""
    states = socket_states(pid)
    held: Counter = Counter()
    total = sockets = alive = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        n, s, a = _fds(p, states, held)
        total, sockets, alive = total + n, sockets + s, alive + a
        todo.extend(_children(p))
    return total, sockets, alive, dict(held)


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
            kinds: dict[str, int] = {}
            if slot.service:
                n, sockets, _ = _fds(pid, {}, Counter())
                fds, sockets, live = n - sockets, 0, 0
            else:
                fds, sockets, live, kinds = tree_fds(pid)
            if rss:
                self.series[name].samples.append(Sample(now, pid, rss, fds, sockets, live, kinds))

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
    held0, held1 = statistics.median(s.held for s in first), statistics.median(s.held for s in last)
    all0 = statistics.median(s.fds for s in first)
    return {**out, "rss_first_mib": round(rss0 / 2**20, 1), "rss_last_mib": round(rss1 / 2**20, 1),
            "rss_growth": round(rss1 / rss0 - 1, 4), "fds_first": held0, "fds_last": held1,
            # The growth of all descriptors, with the live connections kept at their first quarter's count.
            "fds_growth": round((held1 - held0) / all0, 4) if all0 else 0.0,
            "all_fds_first": all0,
            "all_fds_last": statistics.median(s.fds for s in last),
            "live_sockets_first": statistics.median(s.live for s in first),
            "live_sockets_last": statistics.median(s.live for s in last),
            "held_kinds_first": first[-1].held_kinds, "held_kinds_last": last[-1].held_kinds}
