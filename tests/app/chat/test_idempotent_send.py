"""Idempotency-Key on sending a message and on regenerating an answer: a repeat after a lost reply stores,
answers and meters once, and streams the first try's answer; a key reused for another request, or
malformed, is refused."""
from __future__ import annotations

import asyncio

from sqlalchemy import func, select

from chatloom.app.chat import resend
from chatloom.app.chat.conversation_service import GenerationOptions
from chatloom.store import Conversation, DailyUsage, Message, User

from app_testing import done_of, new_conversation, parse_sse, tokens_of


async def _post(client, headers, cid, text, key, **extra):
    return await client.post(f"/conversations/{cid}/messages", json={"text": text, "max_tokens": 8, **extra},
                             headers={**headers, "Idempotency-Key": key})


async def _counts(app, cid) -> tuple[int, int]:
    async with app.state.ctx.db.session() as s:
        messages = await s.scalar(select(func.count()).select_from(Message).where(Message.conversation_id == cid))
        requests = await s.scalar(select(func.coalesce(func.sum(DailyUsage.requests), 0)))
    return messages, requests


async def _until_metered(app, cid, requests: int) -> None:
    while (await _counts(app, cid))[1] < requests:  # usage is written as the answer ends
        await asyncio.sleep(0.01)


def _look_up_late(monkeypatch, name: str) -> list[str]:
    """resend.<name> misses its first look-up, as a request past the route's look-up before the first one
    committed would; the keys it was asked for are listed."""
    earlier, calls = getattr(resend, name), []

    async def late_look_up(session, conversation_id, key, other):
        calls.append(key)
        return None if len(calls) == 1 else await earlier(session, conversation_id, key, other)

    monkeypatch.setattr(resend, name, late_look_up)
    return calls


async def test_a_repeated_send_streams_the_first_answer_and_is_stored_and_metered_once(client, app, alice):
    cid = await new_conversation(client, alice)
    first = await _post(client, alice, cid, "What is a paged KV cache?", "send-1")
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    await _until_metered(app, cid, 1)
    again = await _post(client, alice, cid, "What is a paged KV cache?", "send-1")
    assert again.status_code == 200, again.text
    assert again.headers["idempotent-replayed"] == "true"
    for header in ("x-message-id", "x-user-message-id", "x-conversation-id"):
        assert again.headers[header] == first.headers[header]
    first_events, again_events = parse_sse(first.text), parse_sse(again.text)
    assert tokens_of(again_events) == tokens_of(first_events) != ""
    assert done_of(again_events) == done_of(first_events)
    assert await _counts(app, cid) == (2, 1)  # one user message, one answer, one metered request

    other = await _post(client, alice, cid, "And prefix caching?", "send-2")  # a new key is a new message
    assert other.status_code == 200 and "idempotent-replayed" not in other.headers
    await _until_metered(app, cid, 2)
    assert await _counts(app, cid) == (4, 2)


async def test_the_same_key_in_another_conversation_is_another_message(client, app, alice):
    a, b = await new_conversation(client, alice), await new_conversation(client, alice)
    ra = await _post(client, alice, a, "hello", "k")
    rb = await _post(client, alice, b, "hello", "k")
    assert ra.status_code == rb.status_code == 200
    assert "idempotent-replayed" not in rb.headers and rb.headers["x-message-id"] != ra.headers["x-message-id"]


async def test_a_key_reused_for_other_text_is_422_and_stores_nothing(client, app, alice):
    cid = await new_conversation(client, alice)
    assert (await _post(client, alice, cid, "first text", "k1")).status_code == 200
    r = await _post(client, alice, cid, "other text", "k1")
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "idempotency_key_reused" and r.json()["error"]["param"] == "Idempotency-Key"
    assert (await _counts(app, cid))[0] == 2


async def test_a_malformed_key_is_400_and_stores_nothing(client, app, alice):
    cid = await new_conversation(client, alice)
    for key in ("has space", "x" * 101, "é"):
        r = await client.post(f"/conversations/{cid}/messages", json={"text": "hi"},
                              headers={**alice, "Idempotency-Key": key.encode("utf-8")})
        assert r.status_code == 400, (key, r.text)
        assert r.json()["error"]["code"] == "invalid_idempotency_key"
    assert (await _counts(app, cid))[0] == 0


async def test_a_send_that_loses_the_race_for_its_key_stores_nothing(client, app, alice, monkeypatch):
    """Two sends with one key, the second past the route's look-up before the first committed (a gateway
    paused meanwhile, say): the database's unique key refuses the second, which gives back its claim and
    run, and the route replays the first."""
    cid = await new_conversation(client, alice)
    first = await _post(client, alice, cid, "hello there", "race")
    await _until_metered(app, cid, 1)
    ctx = app.state.ctx
    async with ctx.db.session() as session:
        conv = await session.get(Conversation, cid)
        owner = await session.get(User, conv.user_id)
        try:
            await ctx.conversations.send(session, conv, "hello there", GenerationOptions(owner, max_tokens=8),
                                         client_key="race")
        except resend.AlreadySent:
            pass
        else:
            raise AssertionError("the second send with the key was stored")
    assert await _counts(app, cid) == (2, 1)
    assert ctx.conversations.running(cid) is None  # its claim was given back: the conversation takes sends
    calls = _look_up_late(monkeypatch, "earlier_send")
    again = await _post(client, alice, cid, "hello there", "race")
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.headers["x-message-id"] == first.headers["x-message-id"] and len(calls) == 2
    nxt = await _post(client, alice, cid, "next", "after-race")
    assert nxt.status_code == 200 and "idempotent-replayed" not in nxt.headers


async def test_a_replay_whose_stream_is_gone_is_409_naming_the_answer(client, app, alice):
    cid = await new_conversation(client, alice)
    first = await _post(client, alice, cid, "hello", "gone")
    logs = app.state.ctx.conversations.logs
    get = logs.get

    async def nothing(key):
        return None

    logs.get = nothing
    try:
        r = await _post(client, alice, cid, "hello", "gone")
    finally:
        logs.get = get
    assert r.status_code == 409 and r.json()["error"]["code"] == "already_sent"
    assert first.headers["x-message-id"] in r.json()["error"]["message"]


async def _regenerate(client, headers, cid, message_id, key):
    return await client.post(f"/conversations/{cid}/messages/{message_id}/regenerate", json={"max_tokens": 8},
                             headers={**headers, "Idempotency-Key": key})


async def test_a_repeated_regeneration_streams_its_first_answer_and_is_stored_and_metered_once(client, app, alice):
    cid = await new_conversation(client, alice)
    sent = await _post(client, alice, cid, "What is a paged KV cache?", "send-1")
    await _until_metered(app, cid, 1)
    first = await _regenerate(client, alice, cid, sent.headers["x-message-id"], "again-1")
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    assert first.headers["x-message-id"] != sent.headers["x-message-id"]
    await _until_metered(app, cid, 2)
    again = await _regenerate(client, alice, cid, sent.headers["x-message-id"], "again-1")
    assert again.status_code == 200, again.text
    assert again.headers["idempotent-replayed"] == "true"
    for header in ("x-message-id", "x-user-message-id", "x-conversation-id"):
        assert again.headers[header] == first.headers[header]
    first_events, again_events = parse_sse(first.text), parse_sse(again.text)
    assert tokens_of(again_events) == tokens_of(first_events) != ""
    assert done_of(again_events) == done_of(first_events)
    # Named by the new answer or by the question, the repeat is the same request.
    for target in (first.headers["x-message-id"], sent.headers["x-user-message-id"]):
        r = await _regenerate(client, alice, cid, target, "again-1")
        assert r.status_code == 200 and r.headers["x-message-id"] == first.headers["x-message-id"]
    assert await _counts(app, cid) == (3, 2)  # the question, two answers; two metered requests

    other = await _regenerate(client, alice, cid, sent.headers["x-message-id"], "again-2")
    assert other.status_code == 200 and "idempotent-replayed" not in other.headers
    await _until_metered(app, cid, 3)
    assert await _counts(app, cid) == (4, 3)


async def test_a_key_used_for_another_request_is_422_on_regenerate_and_on_send(client, app, alice):
    cid = await new_conversation(client, alice)
    one = await _post(client, alice, cid, "first question", "q1")
    await _until_metered(app, cid, 1)
    two = await _post(client, alice, cid, "second question", "q2")
    await _until_metered(app, cid, 2)
    assert (await _regenerate(client, alice, cid, two.headers["x-message-id"], "r2")).status_code == 200
    await _until_metered(app, cid, 3)
    refused = [
        await _regenerate(client, alice, cid, one.headers["x-message-id"], "q1"),  # a send's key
        await _regenerate(client, alice, cid, one.headers["x-message-id"], "r2"),  # another question's answer
        await _post(client, alice, cid, "third question", "r2"),  # a regeneration's key on a send
    ]
    for r in refused:
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "idempotency_key_reused"
        assert r.json()["error"]["param"] == "Idempotency-Key"
    assert await _counts(app, cid) == (5, 3)
    malformed = await client.post(f"/conversations/{cid}/messages/{one.headers['x-message-id']}/regenerate",
                                  json={}, headers={**alice, "Idempotency-Key": "has space"})
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_idempotency_key"
    assert await _counts(app, cid) == (5, 3)


async def test_a_regeneration_that_loses_the_race_for_its_key_stores_nothing(client, app, alice, monkeypatch):
    cid = await new_conversation(client, alice)
    sent = await _post(client, alice, cid, "hello there", "send")
    await _until_metered(app, cid, 1)
    first = await _regenerate(client, alice, cid, sent.headers["x-message-id"], "race")
    await _until_metered(app, cid, 2)
    ctx = app.state.ctx
    async with ctx.db.session() as session:
        conv = await session.get(Conversation, cid)
        owner = await session.get(User, conv.user_id)
        try:
            await ctx.conversations.regenerate(session, conv, sent.headers["x-message-id"],
                                               GenerationOptions(owner, max_tokens=8), client_key="race")
        except resend.AlreadySent:
            pass
        else:
            raise AssertionError("the second regeneration with the key was stored")
    assert await _counts(app, cid) == (3, 2)
    assert ctx.conversations.running(cid) is None  # its claim was given back
    calls = _look_up_late(monkeypatch, "earlier_regeneration")
    again = await _regenerate(client, alice, cid, sent.headers["x-message-id"], "race")
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.headers["x-message-id"] == first.headers["x-message-id"] and len(calls) == 2
    assert await _counts(app, cid) == (3, 2)
