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
