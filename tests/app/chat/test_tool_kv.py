"""The tool loops (the chat's, and the Responses API's built-in tools) keep a round's KV cache, ask the backend
to hold or evict it while the tools run, resume from it, and let it go when the answer ends; /metrics counts
what a real engine did with it."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from chatloom.app.tools.registry import ToolRegistry
from chatloom.engine import EngineConfig
from chatloom.engine.held_rounds import common_prefix
from chatloom.serving import BackendStats, GenerationRequest, LocalBackend

from app_testing import (ToolCallingBackend, app_client, call_text, done_of, make_settings, new_conversation, send,
                         tokens_of)
from fake_web import fake_web


@pytest.mark.parametrize("policy", ["auto", "hold", "evict"])
async def test_the_tool_loop_holds_or_evicts_and_resumes_from_the_round(tmp_path, policy):
    backend = ToolCallingBackend()
    settings = make_settings(tmp_path, chat={"tools": "calculator"}, sampling={"max_tokens": 200},
                             tools={"kv_policy": policy, "kv_hold_timeout_s": 7})
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        _, events = await send(client, alice, cid, "calculate 6 * 7")
        assert done_of(events)["status"] == "complete"
        first, second = backend.requests
        assert second.resume_of == first.request_id and first.resume_of is None
        assert first.keep_kv and second.keep_kv
        # Held or evicted while the calculator ran; the last round's kept cache freed when the answer ended.
        assert backend.kv == [("hold", first.request_id, ["calculator"], policy, 7.0),
                              ("release", second.request_id)]


def test_the_hold_counters_are_on_metrics():
    from chatloom.app.traffic.metrics import Metrics
    from chatloom.engine.kv_holds import HoldStats
    from chatloom.serving import BackendStats

    holds = HoldStats(holds=3, evictions=2, pressure_releases=1, reprefilled_tokens=40, block_seconds=12.5,
                      blocks_held=9)
    text = Metrics(lambda: BackendStats(ready=True, num_requests_running=0, kv_holds=holds),
                   lambda: "m").render().decode()
    for line in ('chatloom:kv_tool_holds_total{model_name="m"} 3.0', 'chatloom:kv_tool_evictions_total{model_name="m"} 2.0',
                 'chatloom:kv_tool_pressure_releases_total{model_name="m"} 1.0',
                 'chatloom:kv_tool_reprefilled_tokens_total{model_name="m"} 40.0',
                 'chatloom:kv_tool_block_seconds_total{model_name="m"} 12.5',
                 'chatloom:kv_tool_blocks_held{model_name="m"} 9.0'):
        assert line in text


async def test_stopping_an_answer_mid_tool_lets_its_kv_cache_go_at_once(tmp_path, monkeypatch):
    backend = ToolCallingBackend()
    started, finish = asyncio.Event(), asyncio.Event()
    run = ToolRegistry.run

    async def slow_run(self, call, ctx):
        started.set()
        await finish.wait()
        return await run(self, call, ctx)

    monkeypatch.setattr(ToolRegistry, "run", slow_run)
    settings = make_settings(tmp_path, chat={"tools": "calculator"}, sampling={"max_tokens": 200},
                             tools={"kv_policy": "hold"})
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        answer = asyncio.create_task(send(client, alice, cid, "calculate 6 * 7"))
        async with asyncio.timeout(30):
            await started.wait()
            round_id = backend.requests[0].request_id
            stop = asyncio.create_task(client.post(f"/conversations/{cid}/stop", headers=alice))
            # The held round is let go while its tool still runs, not when the tool returns.
            while ("abort", round_id) not in backend.kv:
                await asyncio.sleep(0.01)
            assert backend.kv[0] == ("hold", round_id, ["calculator"], "hold", 60.0)
            finish.set()
            await stop
            _, events = await answer
        assert done_of(events)["status"] == "stopped"
        assert len(backend.requests) == 1  # no resume


@pytest.mark.parametrize("policy", ["auto", "hold", "evict"])
async def test_the_responses_builtin_tools_hold_or_evict_by_the_same_policy(tmp_path, policy):
    backend = ToolCallingBackend()
    with fake_web() as web:
        settings = make_settings(tmp_path, sampling={"max_tokens": 200}, moderation={"mode": "off"},
                                 tools={"search_url": web.base, "kv_policy": policy, "kv_hold_timeout_s": 7})
        async with app_client(settings, backend) as (client, app, alice):
            body = {"model": "scripted", "input": call_text("web_search", query="otters"),
                    "tools": [{"type": "web_search"}]}
            r = await client.post("/v1/responses", headers=alice, json=body)
            assert r.status_code == 200, r.text
            assert [it["type"] for it in r.json()["output"]] == ["web_search_call", "message"]
            first, second = backend.requests
            assert first.keep_kv and second.keep_kv and second.resume_of == first.request_id
            # Held or evicted while the search ran; the last round's kept cache freed when the response ended.
            assert backend.kv == [("hold", first.request_id, ["web_search"], policy, 7.0),
                                  ("release", second.request_id)]

            # With only the client's functions, nothing resumes on the server: nothing is kept.
            backend.requests.clear(), backend.kv.clear()
            function = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
            r = await client.post("/v1/responses", headers=alice,
                                  json={**body, "input": call_text("lookup"), "tools": [function]})
            assert r.json()["output"][0]["type"] == "function_call"
            assert not backend.requests[0].keep_kv and backend.kv == []


class EngineBeside(ToolCallingBackend):
    """The scripted model's text, while a real engine runs every request beside it (a few tokens) under the
    same KV-cache instructions, so the blocks a hold keeps are real blocks."""

    def __init__(self, real: LocalBackend) -> None:
        super().__init__()
        self.real = real

    async def stream(self, request: GenerationRequest):
        async for _ in self.real.stream(replace(request, model=None, max_tokens=3)):
            pass
        async for delta in super().stream(request):
            yield delta

    def hold_kv(self, request_id: str, tools: list[str], policy: str, timeout_s: float) -> None:
        super().hold_kv(request_id, tools, policy, timeout_s)
        self.real.hold_kv(request_id, tools, policy, timeout_s)

    def release_kv(self, request_id: str) -> None:
        super().release_kv(request_id)
        self.real.release_kv(request_id)

    def stats(self) -> BackendStats:
        return self.real.stats()


@pytest.mark.parametrize("policy", ["hold", "evict"])
async def test_a_responses_builtin_tool_runs_beside_the_blocks_its_round_holds(tmp_path, monkeypatch, policy,
                                                                             tiny_model_fp32):
    real = LocalBackend(tiny_model_fp32, engine_config=EngineConfig(num_blocks=128, block_size=16))
    await real.start()
    backend, seen = EngineBeside(real), []
    run = ToolRegistry.run

    async def counting_run(self, call, ctx):
        async with asyncio.timeout(10):  # the decision reaches the engine at its next step
            while (real.engine.snapshot().kv_holds.holds + real.engine.snapshot().kv_holds.evictions) == 0:
                await asyncio.sleep(0.01)
        seen.append(real.engine.snapshot().kv_holds.blocks_held)
        return await run(self, call, ctx)

    monkeypatch.setattr(ToolRegistry, "run", counting_run)
    try:
        with fake_web() as web:
            settings = make_settings(tmp_path, sampling={"max_tokens": 200}, moderation={"mode": "off"},
                                     tools={"search_url": web.base, "kv_policy": policy})
            async with app_client(settings, backend) as (client, app, alice):
                body = {"model": "scripted", "input": call_text("web_search", query="otters"),
                        "tools": [{"type": "web_search"}]}
                r = await client.post("/v1/responses", headers=alice, json=body)
                assert r.status_code == 200, r.text
        # While the search ran, the round's blocks were held (or not, evicted); the resume took them.
        [blocks] = seen
        assert blocks > 0 if policy == "hold" else blocks == 0
        async with asyncio.timeout(30):
            while real.engine.snapshot().kv_holds.held_sequences:
                await asyncio.sleep(0.01)
        stats = real.engine.snapshot().kv_holds
        assert stats.adopted == (1 if policy == "hold" else 0) and stats.resumes == 1
    finally:
        await real.close()


def _counter(metrics: str, name: str) -> float:
    """The value of one chatloom:kv_tool_* sample on a /metrics page."""
    return float(next(line for line in metrics.splitlines() if line.startswith(f"chatloom:kv_tool_{name}{{"))
                 .rsplit(" ", 1)[1])


@pytest.mark.parametrize("policy", ["hold", "evict"])
async def test_metrics_count_the_holds_and_evictions_of_a_real_engine_during_a_chat_tool_call(
        tmp_path, policy, tiny_model_fp32):
    real = LocalBackend(tiny_model_fp32, engine_config=EngineConfig(num_blocks=128, block_size=16))
    await real.start()
    backend = EngineBeside(real)
    names = ("holds_total", "evictions_total", "reprefilled_tokens_total", "block_seconds_total",
             "pressure_releases_total", "timeouts_total", "blocks_held")
    try:
        settings = make_settings(tmp_path, chat={"tools": "calculator"}, sampling={"max_tokens": 200},
                                 tools={"kv_policy": policy})
        async with app_client(settings, backend) as (client, app, alice):
            before = (await client.get("/metrics")).text
            assert [_counter(before, n) for n in names] == [0.0] * len(names)
            _, events = await send(client, alice, await new_conversation(client, alice), "calculate 6 * 7")
            assert tokens_of(events) == "Result: 42" and done_of(events)["status"] == "complete"
            # The answer's last round keeps its blocks until the engine's next step lets them go.
            async with asyncio.timeout(30):
                while _counter(after := (await client.get("/metrics")).text, "blocks_held"):
                    await asyncio.sleep(0.01)
        seen = {n: _counter(after, n) for n in names}
        first, second = backend.requests
        shared = common_prefix(real.encode_messages(first.messages), real.encode_messages(second.messages))
        if policy == "hold":
            # The resume adopted every block it shares with the round: nothing computed again.
            assert seen["block_seconds_total"] > 0
            assert {**seen, "block_seconds_total": 0} == {n: 0.0 for n in names} | {"holds_total": 1.0}
        else:
            # The full blocks came back from the prefix cache; the shared tokens of the partial one did not.
            assert shared % 16, "the shared prompt fills whole blocks: no partial block is left to lose"
            assert seen == {n: 0.0 for n in names} | {"evictions_total": 1.0, "reprefilled_tokens_total": shared % 16}
    finally:
        await real.close()
