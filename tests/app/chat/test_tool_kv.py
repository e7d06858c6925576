"""The chat's tool loop keeps a round's KV cache, asks the backend to hold or evict it while the tools run,
resumes from it, and lets it go when the answer ends."""
from __future__ import annotations

import asyncio

import pytest

from chatloom.app.tools.registry import ToolRegistry

from app_testing import ToolCallingBackend, app_client, done_of, make_settings, new_conversation, send


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
