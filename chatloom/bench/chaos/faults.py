"""The chaos run's faults: a seeded schedule, and the code that injects each one and sees it over.

Each fault's window runs from its start to `end` (the process back and ready, the disk freed, the
paused replica continued); then every gateway must answer /readyz with 200 (`ready`). Faults of one
group (the gateways, the replicas, the backing services, the disk) wait for each other, so there is
always one gateway and two replicas up; faults of different groups overlap, so faults arrive while
others are still being recovered. Client connections cut mid-stream are the traffic's own doing
(chatloom/bench/chaos/traffic.py) and are counted there.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass

import httpx

from chatloom.bench.chaos.ledger import Fault, Ledger
from chatloom.bench.chaos.topology import Topology

KINDS = ("replica_kill", "replica_pause", "gateway_kill", "gateway_term", "redis_restart_keep",
         "redis_restart_wipe", "postgres_restart", "disk_full")
GROUP = {"replica_kill": "replicas", "replica_pause": "replicas", "gateway_kill": "gateways",
         "gateway_term": "gateways", "redis_restart_keep": "services", "redis_restart_wipe": "services",
         "postgres_restart": "services", "disk_full": "disk"}
READY_WAIT_S = 60.0  # how long to look for every gateway ready after a fault (the limit checked is 10 s)


@dataclass(frozen=True)
class Planned:
    at_s: float  # seconds after the traffic started
    kind: str
    target: int  # which replica or gateway (index); 0 for the others


def schedule(seed: int, window_s: float, short: bool) -> list[Planned]:
    """Every kind once per round, in a seeded order, spread over the window, the last fifth left for the
    run to settle. The short run keeps its first quarter quiet (the baseline its processes' memory is
    compared with) and puts the faults that restart processes first, so they are back and warm before
    the last quarter."""
    rng = random.Random(seed)
    rounds = 1 if short else max(1, int(window_s // 180))
    kinds: list[str] = []
    for _ in range(rounds):
        order = list(KINDS)
        rng.shuffle(order)
        if short:
            slow = ["gateway_kill", "replica_kill", "gateway_term"]
            order = slow + [k for k in order if k not in slow]
        kinds.extend(order)
    start, end = (0.25, 0.72) if short else (0.0, 0.8)
    span = window_s * (end - start) / len(kinds)
    return [Planned(round(window_s * start + span * (i + 0.25 + 0.5 * rng.random()), 1), kind,
                    rng.randrange(3 if kind.startswith("replica") else 2)) for i, kind in enumerate(kinds)]


class Injector:
    def __init__(self, topology: Topology, ledger: Ledger, seed: int) -> None:
        self.topology = topology
        self.ledger = ledger
        self.rng = random.Random(seed ^ 0x5EED)
        self.locks = {group: asyncio.Lock() for group in set(GROUP.values())}
        self.restarting: set[str] = set()  # gateways a fault has down: the others' readiness is what counts

    async def run(self, plan: list[Planned], t0: float, stop: asyncio.Event) -> None:
        tasks = []
        for p in plan:
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, t0 + p.at_s - time.monotonic()))
                break
            except asyncio.TimeoutError:
                pass
            tasks.append(asyncio.create_task(self.inject(p)))
        await asyncio.gather(*tasks)

    async def inject(self, p: Planned) -> None:
        async with self.locks[GROUP[p.kind]]:
            do = getattr(self, "_" + p.kind)
            fault = Fault(p.kind, "", time.monotonic())
            self.ledger.faults.append(fault)
            try:
                await do(fault, p.target)
            except Exception as exc:  # noqa: BLE001 - a failed injection is reported, and the run goes on
                fault.note = f"injection failed: {type(exc).__name__}: {exc}"
            fault.end = fault.end or time.monotonic()
            fault.ready = await self._all_ready(fault.end)

    async def _all_ready(self, since: float) -> float | None:
        """When every gateway answered /readyz 200, or None if not within READY_WAIT_S."""
        async with httpx.AsyncClient(verify=False, timeout=3.0) as client:
            while time.monotonic() < since + READY_WAIT_S:
                ok = True
                for g in self.topology.gateways:
                    if g.name in self.restarting:
                        continue
                    try:
                        ok = ok and (await client.get(g.url + "/readyz")).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                if ok:
                    return time.monotonic()
                await asyncio.sleep(0.2)
        return None

    async def _replica_kill(self, fault: Fault, target: int) -> None:
        replica = self.topology.replicas[target]
        fault.target = replica.name
        await asyncio.to_thread(replica.kill)
        await asyncio.sleep(self.rng.uniform(1.0, 4.0))
        await asyncio.to_thread(lambda: replica.launch().wait_ready())

    async def _replica_pause(self, fault: Fault, target: int) -> None:
        replica = self.topology.replicas[target]
        fault.target = replica.name
        replica.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(self.rng.uniform(3.0, 8.0))
        finally:
            replica.signal(signal.SIGCONT)

    async def _gateway_kill(self, fault: Fault, target: int) -> None:
        gateway = self.topology.gateways[target]
        fault.target = gateway.name
        self.restarting.add(gateway.name)
        try:
            await asyncio.to_thread(gateway.kill)
            await asyncio.to_thread(lambda: gateway.launch().wait_ready())
        finally:
            self.restarting.discard(gateway.name)

    async def _gateway_term(self, fault: Fault, target: int) -> None:
        gateway = self.topology.gateways[target]
        fault.target = gateway.name
        self.restarting.add(gateway.name)
        try:
            status = await asyncio.to_thread(gateway.terminate)
            fault.note = f"exit status {status}"
            await asyncio.to_thread(lambda: gateway.launch().wait_ready())
        finally:
            self.restarting.discard(gateway.name)

    async def _redis_restart_keep(self, fault: Fault, target: int) -> None:
        fault.target = "redis"
        await asyncio.to_thread(self.topology.redis.restart, True)

    async def _redis_restart_wipe(self, fault: Fault, target: int) -> None:
        fault.target = "redis"
        await asyncio.to_thread(self.topology.redis.restart, False)

    async def _postgres_restart(self, fault: Fault, target: int) -> None:
        fault.target = "postgres"
        await asyncio.to_thread(self.topology.postgres.restart)

    async def _disk_full(self, fault: Fault, target: int) -> None:
        fault.target = "data folder"
        if not self.topology.tmpfs:
            fault.note = f"skipped: no tmpfs could be mounted ({self.topology.tmpfs_error})"
            return
        filler = self.topology.data / "chaos-filler"
        fault.note = f"filled {await asyncio.to_thread(_fill, filler)} bytes"
        try:
            await asyncio.sleep(self.rng.uniform(5.0, 10.0))
        finally:
            filler.unlink(missing_ok=True)


def _fill(path) -> int:
    """Write to `path` until the file system is full; the bytes written."""
    written = 0
    block = b"\0" * (1 << 16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            try:
                written += os.write(fd, block)
            except OSError:
                if len(block) == 1:
                    return written
                block = block[: len(block) // 2]
    finally:
        os.close(fd)
