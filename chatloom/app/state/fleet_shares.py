"""Admission shares counted across the fleet: the reasoning share and the tiers' reserved shares.

Each gateway's admission queue decides alone and at once (it must not wait on Redis for every
grant), so the fleet-wide figures are a view refreshed every `interval_s`: each gateway publishes
what it runs (reasoning and interactive generations, its slot count) under a key that expires if the
gateway dies, and pushes the tier of each admission onto one shared list of recent admissions. The
queue then counts the other gateways' reasoning generations against the fleet's reasoning share
(floor(share x all gateways' slots)), and measures a tier's share over the fleet's recent admissions.
Staleness is at most one interval (0.2 s by default); without Redis the queue counts only its own.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

import redis.asyncio as redis

from chatloom.app.state.background import cancel_requested, stop_loop

log = logging.getLogger(__name__)


class FleetShares:
    def __init__(self, client: redis.Redis, gateway: str, prefix: str = "chatloom", window: int = 20,
                 interval_s: float = 0.2) -> None:
        self.client = client
        self.gateway = gateway
        self.prefix = prefix
        self.window = window
        self.interval_s = interval_s
        # The view the admission queue reads (the other gateways' figures, and the fleet's recent tiers).
        self.others_reasoning = 0
        self.others_running = 0
        self.others_max_running = 0
        self.recent: deque[str] = deque(maxlen=window)
        self.local_reasoning = 0
        self.local_running = 0
        self.local_max_running = 0
        self._granted: list[str] = []  # tiers admitted here since the last flush
        self._task: asyncio.Task | None = None
        self.synced = asyncio.Event()

    @property
    def _gateways(self) -> str:
        return f"{self.prefix}:admission:gateways"

    def _gateway_key(self, gateway: str) -> str:
        return f"{self.prefix}:admission:gateway:{gateway}"

    @property
    def _recent_key(self) -> str:
        return f"{self.prefix}:admission:recent"

    # -- called by the admission queue (never awaits) ------------------------------------------
    def granted(self, tier_name: str, reasoning: bool) -> None:
        self._granted.append(tier_name)
        self.recent.appendleft(tier_name)  # seen at once here; the shared list catches up at the flush
        self.local_running += 1
        self.local_reasoning += 1 if reasoning else 0

    def released(self, reasoning: bool) -> None:
        self.local_running = max(0, self.local_running - 1)
        if reasoning:
            self.local_reasoning = max(0, self.local_reasoning - 1)

    # -- the sync loop ---------------------------------------------------------------------------
    async def start(self, max_running: int) -> None:
        self.local_max_running = max_running
        self._task = asyncio.create_task(self._loop(), name="fleet-shares")

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync()
                self.synced.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: keep the last view, try again
                if cancel_requested():
                    raise asyncio.CancelledError from exc
                log.debug("fleet shares not synced: %s", exc)
            await asyncio.sleep(self.interval_s)

    async def sync(self) -> None:
        granted, self._granted = self._granted, []
        ttl_ms = max(1000, int(self.interval_s * 5000))
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(self._gateway_key(self.gateway), mapping={
                "reasoning": self.local_reasoning, "running": self.local_running, "max": self.local_max_running})
            pipe.pexpire(self._gateway_key(self.gateway), ttl_ms)
            pipe.sadd(self._gateways, self.gateway)
            if granted:
                pipe.lpush(self._recent_key, *granted)
                pipe.ltrim(self._recent_key, 0, self.window - 1)
            pipe.smembers(self._gateways)
            pipe.lrange(self._recent_key, 0, self.window - 1)
            replies = await pipe.execute()
        members, recent = replies[-2], replies[-1]
        others = [m.decode() for m in members if m.decode() != self.gateway]
        reasoning = running = max_running = 0
        if others:
            async with self.client.pipeline(transaction=False) as pipe:
                for g in others:
                    pipe.hgetall(self._gateway_key(g))
                figures = await pipe.execute()
            gone = []
            for g, f in zip(others, figures):
                if not f:
                    gone.append(g)
                    continue
                reasoning += int(f.get(b"reasoning", 0))
                running += int(f.get(b"running", 0))
                max_running += int(f.get(b"max", 0))
            if gone:
                await self.client.srem(self._gateways, *gone)
        self.others_reasoning, self.others_running, self.others_max_running = reasoning, running, max_running
        self.recent = deque((r.decode() for r in recent), maxlen=self.window)

    async def close(self) -> None:
        await stop_loop(self._task)
        try:
            await self.client.delete(self._gateway_key(self.gateway))
            await self.client.srem(self._gateways, self.gateway)
        except Exception:
            pass
