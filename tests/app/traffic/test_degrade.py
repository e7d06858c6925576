"""Degrade before refusing: the ladder's steps rise with load, apply to the requests they name, show in
the response and on /metrics, come before the queue refuses even a burst that arrives all at once, and
come down one at a time once load has stayed low."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from chatloom.app.core.errors import ApiError
from chatloom.app.main import create_app
from chatloom.app.traffic.reasoning import BUDGET_TOKENS
from chatloom.app.traffic.tiers import DEFAULT_TIERS
from chatloom.app.traffic.degrade import DegradeLadder, RecentMax, Signals
from chatloom.serving import BackendStats
from chatloom.settings.tree import DegradeSettings

from app_testing import make_settings, signup
from traffic_testing import ScriptedBackend


FREE, PRO = DEFAULT_TIERS["free"], DEFAULT_TIERS["pro"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ladder(signal: list[Signals], clock: Clock, **fields) -> DegradeLadder:
    settings = DegradeSettings(check_interval_s=0.0, hold_s=10.0, **fields)
    return DegradeLadder(settings, 30.0, lambda: signal[0], clock)


def test_steps_rise_with_either_signal_and_fall_one_at_a_time_after_the_hold():
    clock, signal = Clock(), [Signals(0.0, 0.1)]
    d = ladder(signal, clock)
    assert d.update() == 0
    signal[0] = Signals(3.5, 0.1)  # 0.1 x 30 s passed: effort
    assert d.update() == 1 and d.active("effort") and not d.active("small_model")
    signal[0] = Signals(0.0, 0.99)  # KV past every threshold: the steps in order, one a reading
    assert d.update() == 2 and d.active("small_model") and not d.active("max_tokens")
    assert d.update() == 3 and d.active("max_tokens")
    signal[0] = Signals(0.0, 0.96)  # below the top KV threshold but not its clearing level (0.93)
    clock.now += 60
    assert d.update() == 3
    signal[0] = Signals(0.0, 0.5)  # calm: each step waits out the hold before it is undone
    assert d.update() == 3
    clock.now += 9.9
    assert d.update() == 3
    clock.now += 0.2
    assert d.update() == 2
    clock.now += 5
    assert d.update() == 2
    clock.now += 5.1
    assert d.update() == 1
    signal[0] = Signals(2.0, 0.5)  # wait above half the effort threshold (1.5 s): the last step holds
    clock.now += 30
    assert d.update() == 1
    signal[0] = Signals(1.0, 0.5)
    d.update()
    clock.now += 10
    assert d.update() == 0


def test_a_burst_inside_the_hold_restarts_it():
    clock, signal = Clock(), [Signals(0.0, 0.99)]
    d = ladder(signal, clock)
    assert [d.update() for _ in range(4)] == [1, 2, 3, 3]
    signal[0] = Signals(0.0, 0.1)
    d.update()
    clock.now += 8
    signal[0] = Signals(0.0, 0.99)
    d.update()
    signal[0] = Signals(0.0, 0.1)
    clock.now += 5
    assert d.update() == 3  # the calm before the burst does not count


@pytest.mark.parametrize("fields", [{"effort_queue_wait_share": 0.5, "small_model_queue_wait_share": 0.3},
                                    {"small_model_kv_usage": 0.99, "max_tokens_kv_usage": 0.97}])
def test_thresholds_that_do_not_rise_step_by_step_are_refused(fields):
    with pytest.raises(ValueError, match="must rise step by step"):
        DegradeSettings(**fields)


def test_recent_max_forgets_old_values():
    clock = Clock()
    m = RecentMax(5.0, clock)
    m.add(3.0)
    clock.now = 2
    m.add(1.0)
    assert m.value() == 3.0
    clock.now = 5.5
    assert m.value() == 1.0
    clock.now = 8
    assert m.value() == 0.0


class LoadedBackend(ScriptedBackend):
    """Serves a big and a small model, with a KV occupancy the test sets."""

    model_ids = ["big", "small"]

    def __init__(self) -> None:
        super().__init__(["fine"])
        self.kv = 0.1

    def stats(self) -> BackendStats:
        return BackendStats(ready=True, kv_cache_usage_perc=self.kv, num_requests_running=0, num_requests_waiting=0)


async def test_under_load_the_free_tier_moves_to_the_small_model_and_effort_drops_then_all_returns(tmp_path):
    backend = LoadedBackend()
    app = create_app(make_settings(tmp_path, moderation={"mode": "off"},
                                   degrade={"small_model": "small", "hold_s": 0.0, "check_interval_s": 0.0,
                                            "max_tokens_cap": 16}), backend)
    body = {"model": "big", "messages": [{"role": "user", "content": "think about it"}], "max_tokens": 64,
            "reasoning_effort": "high"}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            await signup(c, "root")
            alice = await signup(c, "alice")  # the free tier
            r = await c.post("/v1/chat/completions", json=body, headers=alice)
            assert r.status_code == 200 and "x-chatloom-degraded" not in r.headers
            assert backend.requests[-1].model in (None, "big")
            backend.kv = 0.99  # the burst: the steps come in order, one a reading
            climb = []
            while not climb or climb[-1] != "effort,small_model,max_tokens":
                assert len(climb) < 10, climb
                r = await c.post("/v1/chat/completions", json=body, headers=alice)
                assert r.status_code == 200, r.text
                climb.append(r.headers["x-chatloom-degraded"])
            ladder_order = ["effort", "effort,small_model", "effort,small_model,max_tokens"]
            assert all(h in ladder_order for h in climb) and climb == sorted(climb, key=ladder_order.index), climb
            assert backend.requests[-1].model == "small"
            assert backend.requests[-1].max_tokens == 16 + BUDGET_TOKENS["low"]  # the cap, plus low effort's thinking
            metrics = (await c.get("/metrics")).text
            assert "chatloom:degrade_level 3.0" in metrics
            small = climb.count(ladder_order[1]) + 1  # the requests the small-model step applied to
            assert f'chatloom:degraded_requests_total{{step="small_model"}} {small}.0' in metrics
            backend.kv = 0.1  # the burst is over: one step comes off per reading
            seen = []
            for _ in range(5):  # the first calm reading starts the (zero) hold
                r = await c.post("/v1/chat/completions", json=body, headers=alice)
                seen.append(r.headers.get("x-chatloom-degraded"))
            # One step a reading; the gateway also reads every 0.1 s between requests, so on a slow machine
            # a request may see two readings' steps come off.
            order = ["effort,small_model,max_tokens", "effort,small_model", "effort", None]
            assert seen[0] == order[0] and seen[-2:] == [None, None], seen
            assert [order.index(h) for h in seen] == sorted(order.index(h) for h in seen), seen
            assert backend.requests[-1].model in (None, "big")


async def test_the_steps_come_off_when_the_load_falls_even_with_no_request_to_see_it(tmp_path):
    backend = LoadedBackend()
    app = create_app(make_settings(tmp_path, moderation={"mode": "off"},
                                   degrade={"small_model": "small", "hold_s": 0.2, "check_interval_s": 0.0,
                                            "max_tokens_cap": 4}), backend)
    body = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            root = await signup(c, "root")
            backend.kv = 0.99
            alice = await signup(c, "alice")
            while (await c.get("/admin/ops", headers=root)).json()["degrade"]["level"] < 3:
                await c.post("/v1/chat/completions", json=body, headers=alice)  # each a reading
            r = await c.post("/v1/chat/completions", json=body, headers=alice)
            assert r.headers["x-chatloom-degraded"] == "small_model,max_tokens"
            backend.kv = 0.1  # the burst is over, and nobody asks for anything
            levels = [3]
            deadline = asyncio.get_running_loop().time() + 10
            while levels[-1] > 0:
                assert asyncio.get_running_loop().time() < deadline, f"the ladder stayed at {levels}"
                snap = (await c.get("/admin/ops", headers=root)).json()
                if snap["degrade"]["level"] != levels[-1]:
                    levels.append(snap["degrade"]["level"])
                await asyncio.sleep(0.02)
            assert levels == [3, 2, 1, 0]  # one step at a time
            assert "chatloom:degrade_level 0.0" in (await c.get("/metrics", headers=root)).text


async def test_a_burst_faster_than_the_readings_meets_every_step_before_the_first_refusal(tmp_path):
    """All at once, in one turn of the event loop: no reading sees anyone wait, so before, the queue
    refused the excess at level 0. Each arrival it would refuse now takes the next step instead and
    waits; once every step is taken the excess is refused at once, as before."""
    app = create_app(make_settings(tmp_path, moderation={"mode": "off"}, traffic={"admission_max_running": 2,
                                                                                  "queue_max_wait_s": 1.0},
                                   degrade={"check_interval_s": 60.0}), ScriptedBackend(["fine"]))
    async with app.router.lifespan_context(app):
        traffic = app.state.ctx.traffic
        queue, the_ladder = traffic.admission, traffic.ladder
        for _ in range(4):  # the pace: 2 slots, 0.1 s a run, about 20 admissions a second
            slot = await queue.admit(FREE, 1)
            slot.started()
            await asyncio.sleep(0.1)
            slot.release()
        held = [await queue.admit(PRO, 1) for _ in range(2)]
        assert the_ladder.level == 0
        tickets, levels_at_refusal, waited_at = [], [], []
        for _ in range(100):  # no await in this loop
            level = the_ladder.level
            try:
                traffic.refuse_if_full(PRO, 1)  # the early check, as a request's reservation makes it
                tickets.append(queue.enqueue(PRO, 1))
                if the_ladder.level > level:
                    waited_at.append(len(tickets))
            except ApiError as exc:
                assert exc.code == "queue_full"
                levels_at_refusal.append(the_ladder.level)
        assert the_ladder.level == 3 and len(waited_at) == 3  # one step per arrival it would have refused
        assert levels_at_refusal and set(levels_at_refusal) == {3}  # no refusal before the last step
        assert len(tickets) + len(levels_at_refusal) == 100
        assert waited_at == sorted(waited_at) and waited_at[-1] - waited_at[0] == 2  # three arrivals in a row
        for t in tickets:
            queue.abandon(t)
        for s in held:
            s.release()
