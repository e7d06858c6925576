"""A local fleet kept at the size the predictive autoscaler wants (`chatloom serve --local-replicas auto`).

Every interval it feeds the requests that reached the admission queue to the autoscaler and
reconciles: missing replicas are started (a process each, in a thread so the event loop keeps
streaming) and join the router once they answer; a surplus replica is drained first (the router sends
it nothing new), waits until its last answer has finished, and only then leaves the router and
stops, so scaling down never cuts an answer. `on_resize` hears the number of replicas serving each time
it changes (the gateway admits as many generations at once as they run together). Without a fleet to
act on, the scaler only reports what it would want, for an external autoscaler reading /metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Gauge

from chatloom.serving.autoscale import PredictiveAutoscaler
from chatloom.serving.local_fleet import LocalReplicas
from chatloom.serving.router import Router

log = logging.getLogger(__name__)


class LocalFleetScaler:
    def __init__(self, autoscaler: PredictiveAutoscaler, arrivals: Callable[[], int],
                 router: Router | None = None, local: LocalReplicas | None = None,
                 clock: Callable[[], float] = time.monotonic, drain_poll_s: float = 0.1,
                 on_resize: Callable[[int], None] | None = None) -> None:
        if (router is None) != (local is None):
            raise ValueError("a scaler acts on a router and its local replicas together, or on neither")
        self.autoscaler = autoscaler
        self.arrivals = arrivals
        self.router = router
        self.local = local
        self.clock = clock
        self.drain_poll_s = drain_poll_s
        self.on_resize = on_resize
        self.starting = 0
        self.draining: set[str] = set()
        self._seen = arrivals()
        self._tasks: set[asyncio.Task] = set()

    @property
    def desired(self) -> int:
        return self.autoscaler.desired

    @property
    def serving(self) -> int:
        """Replicas taking new requests (started, not being drained)."""
        if self.router is None:
            return self.autoscaler.desired
        return sum(1 for r in self.router.replicas if r.name not in self.draining)

    def register(self, registry: CollectorRegistry) -> None:
        """The desired and actual sizes and the forecast, on the gateway's /metrics."""
        for name, text, value in (
                ("chatloom:autoscale_desired_replicas", "Replicas the predictive autoscaler wants now.",
                 lambda: self.desired),
                ("chatloom:autoscale_serving_replicas", "Replicas taking new requests.", lambda: self.serving),
                ("chatloom:autoscale_starting_replicas", "Replicas asked for and not ready yet.",
                 lambda: self.starting),
                ("chatloom:autoscale_forecast_requests_per_s", "Forecast arrivals one start-up time ahead.",
                 lambda: self.autoscaler.expected_rps)):
            Gauge(name, text, registry=registry).set_function(value)

    async def run(self) -> None:
        """Tick every interval until cancelled; stopping also stops the replicas it was starting."""
        try:
            while True:
                await asyncio.sleep(self.autoscaler.config.interval_s)
                await self.tick()
        finally:
            for task in list(self._tasks):
                task.cancel()
            for task in list(self._tasks):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def tick(self) -> int:
        """One interval: feed the arrivals since the last tick, then grow or shrink toward the wish."""
        count = self.arrivals()
        want = self.autoscaler.step(count - self._seen, self.clock())
        self._seen = count
        if self.router is not None:
            self._reconcile(want)
        return want

    def _reconcile(self, want: int) -> None:
        have = self.serving + self.starting
        for _ in range(want - have):
            self.starting += 1  # counted now, so the next tick does not ask for it again
            self._spawn(self._grow())
        for _ in range(have - want):
            if self.serving <= 1:
                break
            candidates = [r for r in self.router.replicas if r.name not in self.draining]
            victim = min(candidates, key=lambda r: (r.inflight, -self.router.replicas.index(r)))
            self.draining.add(victim.name)
            self.router.drain(victim.name)
            self._resized()
            self._spawn(self._retire(victim.name))

    def _resized(self) -> None:
        if self.on_resize is not None:
            self.on_resize(self.serving)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _grow(self) -> None:
        try:
            url = await asyncio.to_thread(self.local.add)
            await self.router.add_replica(url)
            self._resized()
            log.warning("autoscaler: replica %s started (%d serving)", url, self.serving)
        except Exception as exc:  # a replica that does not come up: the next tick asks again
            log.error("autoscaler: a new replica did not start: %s", exc)
        finally:
            self.starting -= 1

    async def _retire(self, url: str) -> None:
        while self.router.inflight(url) > 0:  # its answers finish where they are
            await asyncio.sleep(self.drain_poll_s)
        await self.router.remove_replica(url)
        await asyncio.to_thread(self.local.stop_one, url)
        self.draining.discard(url)
        log.warning("autoscaler: replica %s drained and stopped (%d serving)", url, self.serving)
