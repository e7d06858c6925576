"""The autoscaler acting on real local replicas: it starts one as arrivals rise, and drains one as they
fall without cutting the answer that replica is streaming."""
from __future__ import annotations

import asyncio
import time

import pytest

from chatloom.serving import GenerationRequest
from chatloom.serving.autoscale import AutoscaleConfig, PredictiveAutoscaler
from chatloom.serving.local_fleet import LocalReplicas
from chatloom.serving.local_scaler import LocalFleetScaler
from chatloom.serving.router import Router


async def wait_for(condition, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the fleet"
        await asyncio.sleep(0.05)


async def answer(router: Router, text: str, started: asyncio.Event) -> str:
    reason = None
    async for delta in router.stream(GenerationRequest(prompt=text, max_tokens=48, temperature=0.0)):
        started.set()
        if delta.finished:
            reason = delta.finish_reason
    return reason


async def test_it_grows_with_arrivals_and_drains_without_cutting_an_answer(monkeypatch):
    monkeypatch.setenv("CHATLOOM_RUNTIME__KERNELS", "0")  # the tiny model starts in seconds without them
    local = LocalReplicas("tiny-random", 1, threads=1, extra_args=["--num-blocks", "256"])
    local.start(timeout=180)
    router = Router("tiny-random", local.urls)
    await router.start()
    arrivals = [0]
    config = AutoscaleConfig(min_replicas=1, max_replicas=2, capacity_rps=1.0, startup_s=0.0, interval_s=1.0,
                             headroom=1.0, scale_down_hold_s=0.0)
    scaler = LocalFleetScaler(PredictiveAutoscaler(config), lambda: arrivals[0], router, local)
    try:
        arrivals[0] += 5  # five requests in the interval: more than one replica's 1 request/s
        assert await scaler.tick() == 2
        assert scaler.starting == 1
        await wait_for(lambda: scaler.serving == 2 and scaler.starting == 0)
        await wait_for(lambda: all(r.healthy for r in router.replicas))
        assert len(local.procs) == 2
        # An answer streams on each replica; then arrivals stop and one replica is drained.
        events = [asyncio.Event(), asyncio.Event()]
        first = asyncio.create_task(answer(router, "one two three", events[0]))
        await events[0].wait()
        second = asyncio.create_task(answer(router, "four five six", events[1]))
        await events[1].wait()
        assert sorted(r.inflight for r in router.replicas) == [1, 1]
        for _ in range(30):  # no arrivals: the forecast decays, then the (zero) hold passes
            if await scaler.tick() == 1:
                break
        assert scaler.desired == 1 and len(scaler.draining) == 1
        assert await first == "length" and await second == "length"  # neither answer was cut
        await wait_for(lambda: not scaler.draining)
        assert len(router.replicas) == 1 and len(local.procs) == 1 and scaler.serving == 1
        # The one left still answers.
        assert await answer(router, "seven", asyncio.Event()) == "length"
    finally:
        await router.close()
        local.stop()


def test_a_scaler_needs_both_a_router_and_its_replicas():
    config = AutoscaleConfig(min_replicas=1, max_replicas=2, capacity_rps=1.0, startup_s=0.0)
    with pytest.raises(ValueError):
        LocalFleetScaler(PredictiveAutoscaler(config), lambda: 0, router=object(), local=None)


class FakeReplica:
    def __init__(self, name: str) -> None:
        self.name, self.inflight = name, 0


class FakeRouter:
    """The parts of a Router the scaler uses, with answers in flight set by the test."""

    def __init__(self, urls: list[str]) -> None:
        self.replicas = [FakeReplica(u) for u in urls]
        self.held: set[str] = set()

    def drain(self, url: str) -> None:
        self.held.add(url)

    def inflight(self, url: str) -> int:
        return next(r.inflight for r in self.replicas if r.name == url)

    async def add_replica(self, url: str) -> bool:
        self.replicas.append(FakeReplica(url))
        return True

    async def remove_replica(self, url: str) -> None:
        self.replicas = [r for r in self.replicas if r.name != url]


class FakeLocal:
    def __init__(self) -> None:
        self.started, self.stopped = 1, []

    def add(self) -> str:
        self.started += 1
        return f"http://r{self.started}"

    def stop_one(self, url: str) -> None:
        self.stopped.append(url)


async def test_it_tells_the_gateway_each_new_size_as_replicas_join_and_leave():
    router, local, sizes, arrivals = FakeRouter(["http://r1"]), FakeLocal(), [], [0]
    config = AutoscaleConfig(min_replicas=1, max_replicas=2, capacity_rps=1.0, startup_s=0.0, interval_s=1.0,
                             headroom=1.0, scale_down_hold_s=0.0)
    scaler = LocalFleetScaler(PredictiveAutoscaler(config), lambda: arrivals[0], router, local, drain_poll_s=0.01,
                              on_resize=sizes.append)
    arrivals[0] += 5
    assert await scaler.tick() == 2
    await wait_for(lambda: sizes == [2], timeout=5)
    router.replicas[0].inflight, router.replicas[1].inflight = 2, 1  # the less busy new one is drained
    for _ in range(30):
        if await scaler.tick() == 1:
            break
    # Told as the drain starts: the drained replica's answer is still running and it takes nothing new.
    assert sizes == [2, 1] and scaler.draining == {"http://r2"} and local.stopped == []
    router.replicas[1].inflight = 0
    await wait_for(lambda: not scaler.draining, timeout=5)
    assert local.stopped == ["http://r2"] and [r.name for r in router.replicas] == ["http://r1"]


def test_a_replica_the_router_drains_shows_as_draining():
    router = Router("tiny-random", ["http://127.0.0.1:1", "http://127.0.0.1:2"])  # never started
    router.drain("http://127.0.0.1:2")
    assert [r.draining for r in router.stats().replicas] == [False, True]
