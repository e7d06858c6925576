"""Every quota refusal is a 429 before the stream starts, never an error inside a 200.

Two gateways share one Redis (quota counters, event logs) and one database; 200 conversation messages
(chat tools on, as by default, and some answers calling a tool) from one user and 200 OpenAI requests
from another arrive at once, each user on a small daily token limit that covers a fraction of them.
Each is answered either in full or with a 429 carrying Retry-After and the x-ratelimit-* headers, and
the tokens metered stay within each user's limit.
"""
from __future__ import annotations

import asyncio
import json
import re
from contextlib import AsyncExitStack

import pytest

from chatloom.app.generation.tool_calls import render_messages
from chatloom.serving import Delta, GenerationRequest

from app_testing import app_client, done_of, make_settings, new_conversation, parse_sse, send, signup, tokens_of
from backing_services import create_database, drop_database, require_postgres, require_redis
from test_shared_state import gateways
from traffic_testing import ScriptedBackend, write_tiers

DAILY_LIMIT = 8_000
RATELIMIT_HEADERS = [f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens")
                     for what in ("limit", "remaining", "reset")]


class ToolCallingBackend(ScriptedBackend):
    """Counts a token per word (as ScriptedBackend); calls the calculator once for 'calculate X' when
    the prompt lists tools, then answers with the result; otherwise answers with its script."""

    async def stream(self, request: GenerationRequest):
        msgs = request.messages or []
        question = next((m["content"] for m in reversed(msgs) if m["role"] == "user"), "")
        expr = re.search(r"calculate (.+)", question)
        results = [m["content"] for m in msgs if m["role"] == "tool"]
        if not (expr and "<tools>" in msgs[0]["content"]):
            async for delta in super().stream(request):
                yield delta
            return
        self.requests.append(request)
        if results:
            words = ["The", " result", " is", f" {results[-1]}."]
        else:
            call = json.dumps({"name": "calculator", "arguments": {"expression": expr.group(1)}})
            words = ["Computing:", f"\n<tool_call>\n{call}\n</tool_call>"]
        prompt, sent = self.count_prompt_tokens(msgs), 0
        for word in words[: request.max_tokens]:
            await asyncio.sleep(self.delay_s)
            sent += len(word.split())
            yield Delta(word, False, None, prompt, sent)
        yield Delta("", True, "stop" if len(words) <= request.max_tokens else "length", prompt, sent)


@pytest.fixture
def shared_db() -> str:
    """A fresh PostgreSQL database: what gateways share in production (SQLite is one machine's file)."""
    url = asyncio.run(create_database(require_postgres()))
    yield url
    asyncio.run(drop_database(url))


def _refusal_ok(r) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "insufficient_quota", r.text
    assert int(r.headers["retry-after"]) >= 1
    for header in RATELIMIT_HEADERS:
        assert header in r.headers, (header, dict(r.headers))


async def test_every_refusal_is_a_429_across_two_gateways(tmp_path, shared_db):
    tiers = write_tiers(tmp_path, free={"tokens_per_day": DAILY_LIMIT, "tokens_per_minute": 1_000_000,
                                        "requests_per_minute": 100_000, "max_concurrent": 1000})
    backend = ToolCallingBackend([" a", " b", " c", " d", " e", " f"], delay_s=0.002)
    async with AsyncExitStack() as stack:
        g1, g2 = await gateways(
            stack, tmp_path, shared_db, require_redis(), backend, traffic={"tiers_file": tiers},
            moderation={"mode": "off"}, sampling={"max_tokens": 12},
            chat={"tools": "calculator,time,search",
                  "system_prompt": "You are a helpful assistant. Answer clearly and concisely."},
            shared_state={"job_lease_s": 60.0})  # a busy test machine must not look like a dead gateway
        alice, bob = await signup(g1, "alice"), await signup(g2, "bob")
        cids = await asyncio.gather(*(new_conversation((g1, g2)[i % 2], alice) for i in range(200)))
        words = " ".join(f"w{j}" for j in range(50))

        async def message(i: int, cid: str):
            # Every third asks for the calculator, on both gateways: one gateway's requests may all
            # arrive before the other's, and the quota grants those that arrive first.
            text = f"please calculate {i} * 3" if i % 3 == 0 else f"tell me about the number {i}"
            return await (g1, g2)[i % 2].post(f"/conversations/{cid}/messages", headers=alice, json={"text": text})

        async def completion(i: int):
            body = {"model": "scripted", "max_tokens": 20, "stream": i % 2 == 0,
                    "messages": [{"role": "user", "content": f"say something about {i}: {words}"}]}
            return await (g2, g1)[i % 2].post("/v1/chat/completions", headers=bob, json=body)

        replies = await asyncio.gather(*(message(i, c) for i, c in enumerate(cids)),
                                       *(completion(i) for i in range(200)))
        usage = [(await g.get("/usage", headers=who)).json() for g, who in ((g1, alice), (g2, bob))]

    conversation, openai = replies[:200], replies[200:]
    for r in conversation:
        if r.status_code != 200:
            _refusal_ok(r)
            continue
        events = parse_sse(r.text)
        assert not [e for e in events if e.event == "error"], r.text
        assert events[-1].data["done"] is True and events[-1].data["status"] in ("complete", "incomplete"), r.text
    for r in openai:
        if r.status_code != 200:
            _refusal_ok(r)
        elif r.headers["content-type"].startswith("text/event-stream"):
            events = parse_sse(r.text)
            assert events[-1].data == "[DONE]" and not [e for e in events if "error" in e.data], r.text
            assert events[-2].data["choices"][0]["finish_reason"] in ("stop", "length"), r.text
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    # Both kinds were granted and refused, and answers did call the tool (the second round ran).
    for kind in (conversation, openai):
        codes = [r.status_code for r in kind]
        assert codes.count(200) >= 10 and codes.count(429) >= 10, codes
    tool_rounds = [r for r in conversation if r.status_code == 200 and '"tool_result"' in r.text]
    assert tool_rounds, [(i, r.status_code) for i, r in enumerate(conversation)]
    assert all("The result is" in tokens_of(parse_sse(r.text)) for r in tool_rounds)
    for used in usage:
        assert 0 < used["totals"]["total_tokens"] <= DAILY_LIMIT, used


async def test_the_reservation_covers_the_system_prompt_and_the_tool_descriptions(tmp_path):
    """Before the 200, the answer reserves its whole prompt as it will be sent: the system prompt and the
    tool descriptions included, not the conversation's turns alone; the job asks for nothing more, and
    the reservation is settled down to the real count at the end."""
    backend = ScriptedBackend(["x"])
    tiers = write_tiers(tmp_path, free={"tokens_per_day": 1_000_000})
    system = "You are a helpful assistant. Answer clearly and concisely."
    settings = make_settings(tmp_path, traffic={"tiers_file": tiers}, moderation={"mode": "off"}, chat={"tools": "calculator,time,search", "tool_rounds_reserved": 0, "system_prompt": system}, sampling={"max_tokens": 10})
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        quotas = app.state.ctx.traffic.quotas
        asked: list[tuple[str, int]] = []
        reserve, extend = quotas.reserve, quotas.extend

        async def recording_reserve(user_id, tier, tokens, batch=False):
            asked.append(("reserve", tokens))
            return await reserve(user_id, tier, tokens, batch)

        async def recording_extend(reservation, tier, tokens):
            asked.append(("extend", tokens))
            return await extend(reservation, tier, tokens)

        quotas.reserve, quotas.extend = recording_reserve, recording_extend
        user_id = (await client.get("/auth/me", headers=alice)).json()["id"]
        _, events = await send(client, alice, cid, "hello there")
        assert done_of(events)["status"] == "complete"
        used = quotas.day_used(user_id)
    tools = app.state.ctx.conversations.tools.tool_use()
    prompt = render_messages([{"role": "system", "content": system}, {"role": "user", "content": "hello there"}],
                             tools)
    assert backend.requests[0].messages == prompt
    exact = backend.count_prompt_tokens(prompt)
    assert exact > 2 * (backend.count_tokens(system) + 2 + 3)  # the tool list is most of it
    assert asked == [("reserve", exact + 10)]  # once, before the answer, and never topped up
    assert used == exact + 1  # settled to the prompt and the one word said


@pytest.mark.parametrize("reserved, status", [(0, "incomplete"), (1, "complete")])
async def test_tool_rounds_are_paid_from_the_reservation_made_before_the_answer(tmp_path, reserved, status):
    """All rounds share the one reservation. Without a round reserved for it, the round after a tool call
    does not fit and the answer ends as 'length' (not as a quota error); with one, it completes."""
    backend = ToolCallingBackend()
    tiers = write_tiers(tmp_path, free={"tokens_per_day": 1_000_000})
    settings = make_settings(tmp_path, traffic={"tiers_file": tiers}, moderation={"mode": "off"}, chat={"tools": "calculator", "tool_rounds_reserved": reserved}, sampling={"max_tokens": 12})
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        _, events = await send(client, alice, cid, "please calculate 6 * 7")
    assert not [e for e in events if e.event == "error"]
    assert [e.data["tool_result"]["output"] for e in events if "tool_result" in e.data] == ["42"]
    done = done_of(events)
    assert done["status"] == status and done["finish_reason"] == ("length" if reserved == 0 else "stop")
    assert len(backend.requests) == (1 if reserved == 0 else 2)
    if reserved:
        assert tokens_of(events).endswith("The result is 42.")
