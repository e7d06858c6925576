"""GET /admin/ops, the Operations page's snapshot: admins only, its shape, and figures that move
when load is applied (queue, KV occupancy, goodput per class, the degrade step, the autoscaler's
forecast, replicas' states, usage per tier)."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

import httpx

from chatloom.app.main import create_app
from chatloom.serving import BackendStats
from chatloom.serving.backend import ReplicaStatus

from app_testing import make_settings, signup
from traffic_testing import ScriptedBackend

BODY = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


class LoadedBackend(ScriptedBackend):
    """A scripted backend whose KV occupancy rises with the answers running, behind three replicas
    in the three states a router tells apart."""

    def stats(self) -> BackendStats:
        kv = min(1.0, 0.1 + 0.45 * self.running)
        replicas = [ReplicaStatus("http://r1", True, False, self.running, 7, False, 0, load=BackendStats(True, kv_cache_usage_perc=kv)),
                    ReplicaStatus("http://r2", True, True, 0, 3, False, 0),
                    ReplicaStatus("http://r3", False, False, 0, 1, False, 0, error="unreachable")]
        return BackendStats(ready=True, num_requests_running=self.running, kv_cache_usage_perc=kv, replicas=replicas)


async def wait_for(client: httpx.AsyncClient, headers: dict, check: Callable[[dict], bool],
                   timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        snap = (await client.get("/admin/ops", headers=headers)).json()
        if check(snap):
            return snap
        assert time.monotonic() < deadline, f"the snapshot never reached the state: {snap}"
        await asyncio.sleep(0.01)


async def test_admins_only_and_the_shape_of_an_idle_service(tmp_path):
    app = create_app(make_settings(tmp_path, moderation={"mode": "off"}), ScriptedBackend(["a"]))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            root = await signup(c, "root")  # the first account: the admin
            alice = await signup(c, "alice")
            assert (await c.get("/admin/ops")).status_code == 401
            r = await c.get("/admin/ops", headers=alice)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
            r = await c.get("/admin/ops", headers=root)
            assert r.status_code == 200
            snap = r.json()
            schema = (await c.get("/openapi.json")).json()
    assert set(snap) == {"time", "day", "ready", "kv_cache_usage", "arrivals", "queue", "classes", "degrade",
                         "autoscale", "replicas", "usage_by_tier"}
    assert snap["ready"] and snap["kv_cache_usage"] == 0.25 and snap["arrivals"] == 0
    assert snap["queue"]["waiting"] == 0 and snap["queue"]["timeouts"] == 0 and snap["queue"]["max_wait_s"] > 0
    assert snap["classes"] == [] and snap["replicas"] == [] and snap["usage_by_tier"] == []
    assert snap["degrade"] == {"enabled": True, "level": 0, "step": None,
                               "steps": ["effort", "small_model", "max_tokens"]}
    assert snap["autoscale"]["enabled"] is False and snap["autoscale"]["desired"] is None
    assert schema["paths"]["/admin/ops"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/OpsSnapshot"}


async def test_figures_move_under_load(tmp_path):
    backend = LoadedBackend(["a", " b", " c"], delay_s=0.05)
    settings = make_settings(tmp_path, moderation={"mode": "off"},
                             traffic={"admission_max_running": 2, "queue_max_wait_s": 20.0},
                             degrade={"check_interval_s": 0.0},
                             autoscale={"enabled": True, "capacity_rps": 1.0, "interval_s": 0.05, "max_replicas": 8})
    app = create_app(settings, backend)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            root = await signup(c, "root")
            users = [await signup(c, name) for name in ("alice", "bob", "carol")]  # two answers at once each
            idle = (await c.get("/admin/ops", headers=root)).json()
            assert idle["kv_cache_usage"] == 0.1 and idle["autoscale"]["forecast_rps"] == 0.0
            assert [(r["url"], r["state"]) for r in idle["replicas"]] == [
                ("http://r1", "ready"), ("http://r2", "draining"), ("http://r3", "ejected")]
            assert idle["replicas"][2]["error"] == "unreachable" and idle["replicas"][1]["kv_cache_usage"] is None

            load = [asyncio.create_task(c.post("/v1/chat/completions", json=BODY, headers=users[i % 3]))
                    for i in range(5)]
            busy = await wait_for(c, root, lambda s: s["queue"]["waiting"] >= 1 and s["kv_cache_usage"] == 1.0
                                                  and s["arrivals"] == 5)
            assert busy["queue"]["running"] == 2 and busy["replicas"][0]["inflight"] == 2
            assert busy["queue"]["oldest_wait_s"] > 0
            assert busy["replicas"][0]["kv_cache_usage"] == 1.0
            # A request arriving now meets a full KV cache: the ladder climbs to its top step.
            load.append(asyncio.create_task(c.post("/v1/chat/completions", json=BODY, headers=users[2])))
            results = await asyncio.gather(*load)
            assert [r.status_code for r in results] == [200] * 6
            # The queued requests' waits, just now (the ladder's signal keeps the last 5 s).
            assert (await c.get("/admin/ops", headers=root)).json()["queue"]["recent_wait_s"] > 0
            after = await wait_for(c, root, lambda s: s["autoscale"]["forecast_rps"] > 0 and s["queue"]["running"] == 0)
    assert after["degrade"]["level"] == 3 and after["degrade"]["step"] == "max_tokens"
    assert after["queue"]["oldest_wait_s"] == 0 and after["queue"]["waiting"] == 0
    assert after["classes"] == [{"name": "interactive:free", "requests": 6, "goodput_requests": 6,
                                 "goodput_share": 1.0}]
    a = after["autoscale"]
    assert a["enabled"] and not a["acting"] and a["min_replicas"] == 1 and a["max_replicas"] == 8
    assert a["desired"] >= 1 and a["starting"] == 0
    assert len(after["usage_by_tier"]) == 1
    free = after["usage_by_tier"][0]
    assert free["tier"] == "free" and free["users"] == 3 and free["requests"] == 6
    assert free["total_tokens"] == free["prompt_tokens"] + free["completion_tokens"] > 0


class TwoModels(ScriptedBackend):
    """A multi-model backend: each model's router has its replicas."""

    def stats(self) -> BackendStats:
        def model(url: str, healthy: bool) -> BackendStats:
            return BackendStats(True, replicas=[ReplicaStatus(url, healthy, False, 0, 0, False, 0)])
        per_model = {"small": model("http://s1", False), "big": model("http://b1", True)}
        # As MultiModelBackend: the default model's figures, with every model's beside them.
        return dataclasses.replace(per_model["small"], models=per_model)


async def test_every_models_replicas_behind_a_multi_model_backend(tmp_path):
    app = create_app(make_settings(tmp_path, moderation={"mode": "off"}), TwoModels())
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            snap = (await c.get("/admin/ops", headers=await signup(c, "root"))).json()
    assert [(r["url"], r["state"]) for r in snap["replicas"]] == [("http://b1", "ready"), ("http://s1", "ejected")]
    assert snap["kv_cache_usage"] is None and len(snap["replicas"]) == 2
