"""`chatloom bench chaos`: the fleet under seeded faults and mixed traffic, then the invariants.

The run: start the topology, sign the users up (the first account is the admin that sets the others'
tiers), warm every replica, then drive traffic for the window while the faults fire and the processes
are sampled; stop the traffic, let every answer end, and check. Whatever happens (an invariant
failing, an exception, Ctrl-C or SIGTERM), every process the run started is stopped and the tmpfs
unmounted before it returns; the signal handler stops the fleet itself before it unwinds, and no
restart still running in a worker thread starts anything after that.
"""
from __future__ import annotations

import asyncio
import atexit
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from chatloom.bench.chaos import invariants as inv
from chatloom.bench.chaos.faults import Injector, schedule
from chatloom.bench.chaos.ledger import Ledger
from chatloom.bench.chaos.report import logged_errors, summary
from chatloom.bench.chaos.resources import Sampler, Slot
from chatloom.bench.chaos.topology import MODEL, Topology
from chatloom.bench.chaos.traffic import Traffic, User

SETTLE_S = 120.0  # after the window: how long answers may take to end (a takeover, a resume)
USERS = (("chat", "free", 2), ("chat", "plus", 2), ("chat", "tiny", 1), ("openai", "free", 1),
         ("openai", "plus", 1), ("openai", "tiny", 1), ("files", "free", 1))


@dataclass
class ChaosConfig:
    minutes: float = 60.0
    seed: int = 0
    short: bool = False
    workdir: str | None = None  # default: a new folder under the system's temp folder, removed after
    keep: bool = False  # keep the folder (logs, database) after the run

    @property
    def window_s(self) -> float:
        return 150.0 if self.short else self.minutes * 60.0


def run_chaos(config: ChaosConfig, progress=print) -> dict:
    folder = Path(config.workdir or tempfile.mkdtemp(prefix="chatloom-chaos-"))
    topology = Topology(folder, window_s=config.window_s)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def interrupted(signum, frame):
        # Stop the fleet here and now, whatever the main thread was doing, then unwind.
        topology.stop()
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in previous:
        signal.signal(sig, interrupted)
    atexit.register(topology.stop)  # a last resort, should the interpreter leave another way
    try:
        started = time.monotonic()
        progress(f"chaos: starting PostgreSQL, Redis, 3 replicas and 2 gateways in {folder}")
        topology.start()
        progress(f"chaos: fleet up in {time.monotonic() - started:.0f} s; traffic and faults for "
                 f"{config.window_s:.0f} s")
        return asyncio.run(_drive(topology, config, progress))
    finally:
        topology.stop()
        atexit.unregister(topology.stop)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not config.keep:
            topology.remove()


async def _drive(topology: Topology, config: ChaosConfig, progress) -> dict:
    ledger = Ledger()
    traffic = Traffic({g.name: g.url for g in topology.gateways}, MODEL, ledger, config.seed)
    try:
        users = await _users(traffic, ledger)
        await _warm(topology)
        slots = {c.name: Slot(lambda c=c: c.pid, lambda c=c: c.ready_at) for c in [*topology.gateways,
                                                                                *topology.replicas]}
        slots.update({name: Slot(service.pid, lambda service=service: service.ready_at, service=True)
                      for name, service in (("redis", topology.redis), ("postgres", topology.postgres))})
        sampler = Sampler(slots, every_s=2.0 if config.short else 5.0)
        plan = schedule(config.seed, config.window_s, config.short)
        injector = Injector(topology, ledger, config.seed)
        t0 = time.monotonic()
        stop_sampling = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(stop_sampling))
        loops = [asyncio.create_task(traffic.run_user(u, config.seed * 1000 + i)) for i, u in enumerate(users)]
        faults = asyncio.create_task(injector.run(plan, t0, traffic.stop))
        await asyncio.sleep(config.window_s)
        stop_sampling.set()
        await sampling
        traffic.stop.set()
        progress(f"chaos: window over ({len(ledger.faults)} faults, {len(ledger.answers)} answers); settling")
        await faults
        await asyncio.wait(loops, timeout=SETTLE_S)
        for task in loops:
            task.cancel()
        await _answers_ended(topology.postgres.url, SETTLE_S)
        stored = await inv.read_store(topology.postgres.url)
    finally:
        await traffic.close()
    run_users = {stored.users[n]["id"] for n in ledger.users if n in stored.users}
    chat_users = {u.name for u in users if u.role == "chat"}
    tiers = {"free": 10_000_000, "plus": 20_000_000, "tiny": topology.tiny_tokens_per_day}
    checks = [inv.acknowledged_messages_stored(ledger, stored), inv.answers_finished(stored, run_users),
              inv.streams_exact(ledger, stored), inv.quotas_kept(ledger, stored, tiers),
              inv.metering_matches(ledger, stored, chat_users), inv.no_unexpected_5xx(ledger),
              inv.recovered_in_time(ledger), inv.traffic_flowed(ledger), inv.resources_flat(sampler, t0, config.window_s),
              inv.uploads_kept(ledger, stored, topology.data / "blobs")]
    meta = {"client_renewals": traffic.clients.renewals, "config": asdict(config), "window_s": config.window_s, "folders": [str(topology.folder),
            str(topology.pg_folder)], "tmpfs": topology.tmpfs,
            "tmpfs_error": topology.tmpfs_error, "planned_faults": [asdict(p) for p in plan]}
    if not all(c.ok for c in checks):  # the folder goes when the run ends: keep what explains a failure
        meta["log_errors"] = logged_errors(topology.folder)
    return summary(checks, ledger, t0, meta)


async def _users(traffic: Traffic, ledger: Ledger) -> list[User]:
    admin = await traffic.signup("chaos-admin")  # the first account is the admin
    users = []
    for role, tier, count in USERS:
        for i in range(1, count + 1):
            name = f"{role}-{tier}-{i}"
            headers = await traffic.signup(name)
            if tier != "free":
                r = await traffic.request(traffic.rng, "PUT", f"/admin/users/{name}/tier", "admin",
                                          headers=admin, json={"tier": tier})
                if r is None or r.status_code != 200:
                    raise RuntimeError(f"could not set {name}'s tier: {r.text if r is not None else 'no gateway'}")
            ledger.users[name] = tier
            users.append(User(name, tier, role, headers))
    return users


async def _warm(topology: Topology) -> None:
    """One short answer from each replica, so the first samples are of warm processes."""
    async with httpx.AsyncClient(timeout=120) as client:
        for r in topology.replicas:
            await client.post(r.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 8})


async def _answers_ended(url: str, timeout_s: float) -> None:
    """Wait until no answer is still being written (a dead gateway's are taken over or marked
    interrupted by the others)."""
    import asyncpg

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = await asyncpg.connect(url)
            try:
                running = await conn.fetchval("SELECT count(*) FROM messages WHERE role = 'assistant' AND "
                                              "status = 'incomplete' AND finish_reason IS NULL")
            finally:
                await conn.close()
            if running == 0:
                return
        except (OSError, asyncpg.PostgresError):
            pass
        await asyncio.sleep(1.0)
