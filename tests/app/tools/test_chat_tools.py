"""Chat tools: the built-ins (calculator, time, search) and the orchestrator loop in conversations,
driven by a scripted model that calls the calculator when asked to calculate."""
from __future__ import annotations

import json

import pytest

from chatloom.app.generation.tool_calls import ToolCall
from chatloom.app.tools.calculator import evaluate
from chatloom.app.tools.builtins import builtin_registry
from chatloom.app.tools.registry import ToolFailure

from app_testing import ToolCallingBackend, app_client, done_of, make_settings, new_conversation, send, tokens_of


def test_calculator_is_exact_and_safe():
    assert evaluate("17 * 23") == 391
    assert evaluate("2 ^ 10 + sqrt(16)") == 1028
    assert evaluate("-(3 + 4) * 2 / 7") == -2
    for bad, why in [("__import__('os').system('true')", "not allowed"), ("a + 1", "not allowed"),
                     ("9 ** 9 ** 9", "exponents are limited"), ("1 / 0", "division by zero"),
                     ("(1).__class__", "not allowed"), ("1 +", "cannot read"), ("10.0 ** 400", "out of range")]:
        with pytest.raises(ToolFailure, match=why):
            evaluate(bad)


async def test_registry_turns_every_failure_into_a_tool_error():
    reg = builtin_registry(["calculator", "time"])
    ctx = None
    r = await reg.run(ToolCall("c1", "calculator", json.dumps({"expression": "1/0"})), ctx)
    assert r.error == "division by zero"
    r = await reg.run(ToolCall("c2", "calculator", json.dumps({"expr": "1"})), ctx)
    assert "missing expression" in r.error
    r = await reg.run(ToolCall("c3", "nope", "{}"), ctx)
    assert "unknown tool" in r.error
    r = await reg.run(ToolCall("c4", "time", json.dumps({"timezone": "Mars/Base"})), ctx)
    assert "unknown time zone" in r.error
    r = await reg.run(ToolCall("c5", "time", "{}"), ctx)
    assert r.error is None and "UTC" in r.output
    with pytest.raises(ValueError, match="unknown chat tool"):
        builtin_registry(["shell"])


async def test_an_answer_calls_the_calculator_and_resumes_with_the_result(tmp_path):
    backend = ToolCallingBackend(preamble="Let me compute.\n", chunk=7)
    settings = make_settings(tmp_path, chat={"tools": "calculator,time,search"}, sampling={"max_tokens": 200})
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        _, events = await send(client, alice, cid, "please calculate 17 * 23")
        data = [e.data for e in events if isinstance(e.data, dict)]
        call = next(d["tool_call"] for d in data if "tool_call" in d)
        result = next(d["tool_result"] for d in data if "tool_result" in d)
        assert call["name"] == "calculator" and json.loads(call["arguments"]) == {"expression": "17 * 23"}
        assert result == {"id": call["id"], "name": "calculator", "output": "391", "error": None}
        assert tokens_of(events) == "Let me compute.\nResult: 391"
        assert done_of(events)["status"] == "complete"
        # Two rounds: the second prompt is the first plus the call and the result.
        first, second = backend.requests
        assert second.messages[:len(first.messages)] == first.messages
        assert second.messages[-1] == {"role": "tool", "content": "391"}
        assert "<tool_call>" in second.messages[-2]["content"]
        # Stored with the answer in the conversation tree.
        detail = (await client.get(f"/conversations/{cid}", headers=alice)).json()
        answer = detail["messages"][-1]
        assert answer["tool_steps"] == [{"arguments": call["arguments"], **result}]
        assert answer["text"] == "Let me compute.\nResult: 391"
        # The call and the resumed round are on /metrics.
        metrics = (await client.get("/metrics")).text
        assert 'chatloom:tool_calls_total{outcome="ok",tool="calculator"} 1.0' in metrics
        assert 'chatloom:tool_call_seconds_count{tool="calculator"} 1.0' in metrics
        resumed = backend.count_prompt_tokens(second.messages)
        assert f"chatloom:tool_resume_prompt_tokens_total {float(resumed)}" in metrics
        assert "chatloom:tool_resume_cached_tokens_total 0.0" in metrics


async def test_calls_per_answer_are_capped(tmp_path):
    backend = ToolCallingBackend(calls_per_answer=10)
    settings = make_settings(tmp_path, chat={"tools": "calculator", "max_tool_calls_per_answer": 2}, sampling={"max_tokens": 200})
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        _, events = await send(client, alice, cid, "calculate 2 + 2")
        results = [e.data["tool_result"] for e in events if isinstance(e.data, dict) and "tool_result" in e.data]
        assert [r["output"] for r in results] == ["4", "4"]
        # The third round is read as text: no third call runs, the answer ends.
        assert len(backend.requests) == 3 and done_of(events)["status"] == "complete"


async def test_search_finds_only_the_users_own_conversations(tmp_path):
    backend = ToolCallingBackend(preamble="Let me compute.\n", chunk=7)
    settings = make_settings(tmp_path, chat={"tools": "search"}, sampling={"max_tokens": 200})
    async with app_client(settings, backend) as (client, app, alice):
        from app_testing import signup
        bob = await signup(client, "bob")
        await send(client, alice, await new_conversation(client, alice), "my zebra is named Otto")
        await send(client, bob, await new_conversation(client, bob), "bob has a zebra too")
        reg = builtin_registry(["search"])
        from chatloom.app.tools.registry import ToolContext
        from chatloom.store import Users
        async with app.state.ctx.db.session() as session:
            user = await Users(session).by_username("alice")
        ctx = ToolContext(user, app.state.ctx.db, "none")
        r = await reg.run(ToolCall("s", "search", json.dumps({"query": "zebra"})), ctx)
        assert "Otto" in r.output and "bob" not in r.output
