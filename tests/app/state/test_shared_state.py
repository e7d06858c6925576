"""Two gateways in one test process, sharing a database and Redis: quotas, resumable streams, stops,
one answer per conversation, and a Redis that goes away and comes back. (The multi-process suite,
tests/fleet, does the same with real processes, kills and restarts.)"""
from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack

import httpx
import pytest

from chatloom.app.chat.takeover import logged_answer_tokens
from chatloom.app.main import create_app
from chatloom.app.state.jobs import JobRecord
from chatloom.app.state.redis_events import LogTakenOver
from chatloom.app.chat.recovery import mark_interrupted
from chatloom.store import AnswerChunks, Message, Messages

from app_testing import RecordingBackend, make_settings, merge_groups, new_conversation, parse_sse, signup
from backing_services import PrivateRedis, require_redis
from traffic_testing import ScriptedBackend, write_tiers

WORDS = [f" w{i}" for i in range(40)]


async def gateways(stack: AsyncExitStack, tmp_path, db_url: str, redis_url: str, backend, n: int = 2,
                   **settings) -> list[httpx.AsyncClient]:
    """`n` gateways sharing the database and Redis; `backend` is all of theirs, or a list of one each."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    backends = backend if isinstance(backend, list) else [backend] * n
    clients = []
    for i in range(n):
        app = create_app(make_settings(tmp_path, **merge_groups(
            {"server": {"db_url": db_url},
             "shared_state": {"redis_url": redis_url, "prefix": prefix, "gateway_id": f"gw{i + 1}"}}, settings)),
            backends[i])
        await stack.enter_async_context(app.router.lifespan_context(app))
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://gw{i + 1}")
        clients.append(await stack.enter_async_context(client))
    for c in clients:  # wait until each listens for stops
        app = c._transport.app
        await asyncio.wait_for(app.state.ctx.hot.stops.listening.wait(), 5)
    return clients


async def test_a_stream_started_on_one_gateway_resumes_on_the_other(tmp_path, db_url):
    backend = ScriptedBackend(WORDS[:12], delay_s=0.01)
    async with AsyncExitStack() as stack:
        g1, g2 = await gateways(stack, tmp_path, db_url, require_redis(), backend, sampling={"max_tokens": 100})
        alice = await signup(g1, "alice")
        cid = await new_conversation(g1, alice)
        r = await g1.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hi"})
        assert r.status_code == 200
        seen = [e for e in parse_sse(r.text) if e.id][:4]  # what a client had when its connection broke
        last = int(seen[-1].id)
        r = await g2.get(f"/conversations/{cid}/stream", headers={**alice, "Last-Event-ID": str(last)})
        assert r.status_code == 200
        rest = parse_sse(r.text)
        ids = [int(e.id) for e in seen + rest]
        assert ids == list(range(1, len(ids) + 1))  # no gap, no repeat
        text = "".join(e.data.get("token", "") for e in seen + rest)
        assert text == "".join(WORDS[:12]) and rest[-1].data["done"] is True
        # The whole log, read afresh on gateway 2, is the same answer.
        again = parse_sse((await g2.get(f"/conversations/{cid}/stream", headers=alice)).text)
        assert [(e.id, e.data) for e in again] == [(e.id, e.data) for e in seen + rest]


async def test_stop_on_one_gateway_stops_the_answer_running_on_the_other(tmp_path, db_url):
    backend = ScriptedBackend(WORDS, delay_s=0.05)
    async with AsyncExitStack() as stack:
        g1, g2 = await gateways(stack, tmp_path, db_url, require_redis(), backend, sampling={"max_tokens": 100})
        alice = await signup(g1, "alice")
        cid = await new_conversation(g1, alice)

        async def answer():
            return await g1.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hi"})

        running = asyncio.create_task(answer())
        app1 = g1._transport.app
        for _ in range(500):  # until the answer runs on gateway 1
            gen = app1.state.ctx.conversations.running(cid)
            if gen is not None and len(await app1.state.ctx.hot.logs.events(gen.message_id)) >= 1:
                break
            await asyncio.sleep(0.01)
        # A second answer in the same conversation on the other gateway: refused while the first runs,
        # whether sent, regenerated, or continued from the running answer's text (it is "incomplete" while
        # written, so only the fleet's claim tells that another gateway writes it).
        r = await g2.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "again"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "generation_in_progress"
        for action in ("regenerate", "continue"):
            r = await g2.post(f"/conversations/{cid}/messages/{gen.message_id}/{action}", headers=alice, json={})
            assert r.status_code == 409 and r.json()["error"]["code"] == "generation_in_progress", (action, r.text)
        t0 = asyncio.get_running_loop().time()
        r = await g2.post(f"/conversations/{cid}/stop", headers=alice)
        assert r.status_code == 200 and r.json()["stopped"] is True
        assert asyncio.get_running_loop().time() - t0 < 1.0
        events = parse_sse((await running).text)
        done = events[-1].data
        assert done["status"] == "stopped" and done["finish_reason"] == "abort"
        assert len([e for e in events if "token" in e.data]) < len(WORDS)
        conv = (await g2.get(f"/conversations/{cid}", headers=alice)).json()
        assert conv["messages"][-1]["status"] == "stopped"
        # The conversation is free again, on either gateway.
        r = await g2.post(f"/conversations/{cid}/stop", headers=alice)
        assert r.json() == {"stopped": False, "message_id": None}


async def test_quotas_are_shared_by_the_gateways(tmp_path, db_url):
    # Each request reserves 10 tokens (prompt 5 + max_tokens 5); 95 a minute: 9 granted, on both together.
    tiers = write_tiers(tmp_path, free={"tokens_per_minute": 95, "max_concurrent": 100,
                                        "requests_per_minute": 1000})
    backend = ScriptedBackend(["a", " b", " c", " d", " e"], delay_s=0.01)  # uses all 10
    async with AsyncExitStack() as stack:
        g1, g2 = await gateways(stack, tmp_path, db_url, require_redis(), backend, traffic={"tiers_file": tiers}, moderation={"mode": "off"})
        alice = await signup(g1, "alice")
        # The user's day count exists before the burst: started by one empty reservation, as a day's first
        # request starts it, from what metering recorded (a database read the burst would otherwise wait on).
        ctx = g1._transport.app.state.ctx
        me = (await g1.get("/auth/me", headers=alice)).json()
        await ctx.hot.quotas.settle(await ctx.hot.quotas.reserve(me["id"], ctx.traffic.tiers["free"], 0), 0)
        body = {"model": "scripted", "max_tokens": 5, "messages": [{"role": "user", "content": "hi there"}]}
        # One request on each gateway first, so both are known to grant some; then a burst on both, which
        # the shared count must hold to 9 in all (which gateway wins which of the rest is the scheduler's).
        replies = [await g.post("/v1/chat/completions", headers=alice, json=body) for g in (g1, g2)]
        replies += await asyncio.gather(*(g.post("/v1/chat/completions", headers=alice, json=body)
                                          for _ in range(14) for g in (g1, g2)))
        ok = [r for r in replies if r.status_code == 200]
        refused = [r for r in replies if r.status_code == 429]
        assert len(ok) + len(refused) == 30 and len(ok) == 9
        assert sum(r.json()["usage"]["total_tokens"] for r in ok) <= 95
        assert {r.request.url.host for r in ok} == {"gw1", "gw2"}  # both gateways granted some
        assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
        assert {r.json()["error"]["code"] for r in refused} == {"rate_limit_exceeded"}


async def test_redis_lost_means_fast_503s_and_recovery_without_restart(tmp_path, db_url):
    server = PrivateRedis().start()
    backend = ScriptedBackend(["a", "b"])
    try:
        async with AsyncExitStack() as stack:
            g1, g2 = await gateways(stack, tmp_path, db_url, server.url, backend)
            alice = await signup(g1, "alice")
            cid = await new_conversation(g1, alice)
            assert (await g1.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hi"})).status_code == 200
            assert (await g2.get("/readyz")).status_code == 200
            server.stop()
            for g in (g1, g2):
                t0 = asyncio.get_running_loop().time()
                r = await g.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hi"})
                assert r.status_code == 503 and r.json()["error"]["code"] == "redis_unavailable"
                assert "Redis" in r.json()["error"]["message"] and r.headers["Retry-After"] == "1"
                assert asyncio.get_running_loop().time() - t0 < 3.0
                ready = await g.get("/readyz")
                assert ready.status_code == 503 and "Redis" in ready.json()["error"]
            server.start()
            for g in (g1, g2):
                r = await g.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hi"})
                assert r.status_code == 200, r.text
                assert parse_sse(r.text)[-1].data["status"] == "complete"
                assert (await g.get("/readyz")).status_code == 200
    finally:
        server.stop()


async def test_lost_database_is_a_503_on_readyz(tmp_path):
    settings = make_settings(tmp_path, server={"db_url": "postgresql://nobody@127.0.0.1:9/nothing"})
    app = create_app(settings, ScriptedBackend())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.get("/readyz")  # (no lifespan: the database was never reached)
        assert r.status_code == 503 and "database" in r.json()["error"]
        assert r.json()["checks"]["database"]["status"] == "unavailable"


async def _answer_on_the_first_of_two(stack: AsyncExitStack, tmp_path, db_url: str, backend, events: int = 5,
                                     lease_s: float = 0.6):
    """Two gateways with short leases; alice's answer runs on gateway 1 until its log holds `events` events.
    Its budget (1500 tokens) is far beyond what runs before a test freezes it, so a takeover has some left.
    Returns (gateway 1, gateway 2, alice's headers, conversation id, the request's task, the generation)."""
    g1, g2 = await gateways(stack, tmp_path, db_url, require_redis(), backend, shared_state={"job_lease_s": lease_s},
                            moderation={"mode": "off"})
    alice = await signup(g1, "alice")
    cid = await new_conversation(g1, alice)
    app1 = g1._transport.app
    first = asyncio.create_task(g1.post(f"/conversations/{cid}/messages", headers=alice,
                                        json={"text": "hello", "max_tokens": 1500}))
    logs = app1.state.ctx.hot.logs
    for _ in range(1000):
        gen = app1.state.ctx.conversations.running(cid)
        if gen is not None and len(await logs.events(gen.message_id)) >= events:
            return g1, g2, alice, cid, first, gen
        assert not first.done(), "the answer ended before it could be frozen"
        await asyncio.sleep(0.01)
    raise AssertionError(f"the answer never logged {events} events")


async def _freeze_until_taken_over(app1, app2, cid: str) -> None:
    """Gateway 1 drops its copy of the answer and stops renewing its lease; returns once gateway 2 runs it."""
    await app1.state.ctx.conversations.abandon(cid)
    await app1.state.ctx.hot.keeper.close()
    for _ in range(1000):
        if app2.state.ctx.conversations.running(cid) is not None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("gateway 2 never took the answer over")


async def _resume_on(g2: httpx.AsyncClient, cid: str, headers: dict, last: int) -> list:
    """The rest of the answer read on gateway 2 after event `last`; a stream that never ends fails the test."""
    r = await asyncio.wait_for(g2.get(f"/conversations/{cid}/stream", headers={**headers, "Last-Event-ID": str(last)}),
                               30)
    return parse_sse(r.text)


async def test_an_answer_whose_gateway_stops_renewing_is_continued_by_the_other(tmp_path, db_url, tiny_backend):
    async with AsyncExitStack() as stack:
        g1, g2, alice, cid, first, gen = await _answer_on_the_first_of_two(stack, tmp_path, db_url, tiny_backend)
        app1, app2 = g1._transport.app, g2._transport.app
        message_id = gen.message_id
        logs = app1.state.ctx.hot.logs
        # Gateway 1 freezes: its copy of the answer ends unsaved and it stops renewing its lease (in this
        # order, so that no piece of its copy lands after the takeover: that case has its own test below).
        await app1.state.ctx.conversations.abandon(cid)
        await app1.state.ctx.hot.keeper.close()
        before = await logs.events(message_id)  # what the client had read when its connection broke
        assert all(e.answer_tokens is not None for e in before)  # the writer's count travels with the text
        assert [e.answer_tokens for e in before] == sorted(e.answer_tokens for e in before)
        # The client reconnects to gateway 2, which takes the job over when the lease lapses.
        rest = await _resume_on(g2, cid, alice, before[-1].id)
        ids = [e.id for e in before] + [int(e.id) for e in rest]
        assert ids == list(range(1, len(ids) + 1))  # contiguous: no gap, no repeat
        done = rest[-1].data
        assert done.get("done") is True and done["finish_reason"] in ("stop", "length"), rest[-3:]
        text = "".join(e.data.get("token", "") for e in before) + "".join(e.data.get("token", "") for e in rest)
        conv = (await g2.get(f"/conversations/{cid}", headers=alice)).json()
        saved = conv["messages"][-1]
        assert saved["id"] == message_id and saved["text"] == text and saved["status"] == done["status"]
        assert len(text) > len("".join(e.data.get("token", "") for e in before))  # it went on
        # The continued part counts on from the frozen gateway's count, never over the budget.
        after = logged_answer_tokens(await app2.state.ctx.hot.logs.events(message_id))
        assert before[-1].answer_tokens < after <= 1500
        # The end reports both gateways' tokens, as metered (gateway 1 metered none of them).
        totals = (await g2.get("/usage", headers=alice)).json()["totals"]
        assert done["usage"]["completion_tokens"] == totals["completion_tokens"] >= after
        async with app2.state.ctx.db.session() as session:  # kept with the answer for a later end event
            assert (await session.get(Message, message_id)).completion_tokens == totals["completion_tokens"]
        assert await app2.state.ctx.hot.jobs.holder(cid) is None  # the conversation is free again
        first.cancel()


class Starting(RecordingBackend):
    """A restarted gateway's backend: its router is still starting until `started` is set."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.started = False

    ready = property(lambda self: self.started and self.inner.ready)
    tokenizer = property(lambda self: self.inner.tokenizer)  # renders prompts here: can continue an answer


async def test_a_gateway_whose_router_is_starting_takes_no_answer_over(tmp_path, db_url, tiny_backend):
    """Before, a restarted gateway took lapsed answers over at once, and its router, still starting,
    failed them: the answer was saved as an error with no text. It now leaves them until its model can
    serve, then continues them."""
    starting = Starting(tiny_backend)
    async with AsyncExitStack() as stack:
        g1, g2, alice, cid, first, gen = await _answer_on_the_first_of_two(stack, tmp_path, db_url,
                                                                           [tiny_backend, starting])
        app1, app2 = g1._transport.app, g2._transport.app
        jobs2 = app2.state.ctx.hot.jobs
        await app1.state.ctx.conversations.abandon(cid)
        await app1.state.ctx.hot.keeper.close()
        before = await app1.state.ctx.hot.logs.events(gen.message_id)
        for _ in range(1000):  # until the lease has lapsed
            if any(r.conversation_id == cid for r in await jobs2.lapsed()):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the lease never lapsed")
        await app2.state.ctx.hot.keeper.tick()
        assert app2.state.ctx.conversations.running(cid) is None
        assert (await jobs2.holder(cid)).gateway == "gw1"  # left where it was
        r = await g2.post(f"/conversations/{await new_conversation(g2, alice)}/messages", headers=alice,
                          json={"text": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready" and r.headers["retry-after"]
        starting.started = True
        rest = await _resume_on(g2, cid, alice, before[-1].id)
        assert rest[-1].data.get("done") is True and rest[-1].data["status"] in ("complete", "incomplete"), rest[-3:]
        saved = (await g2.get(f"/conversations/{cid}", headers=alice)).json()["messages"][-1]
        assert saved["id"] == gen.message_id and saved["status"] != "error"
        first.cancel()


async def test_a_taken_over_answer_that_had_used_its_budget_ends_as_length(tmp_path, db_url, tiny_backend):
    """The budget left is the job's max_tokens less the count its gateway logged, not a re-count of the
    text (random tokens re-tokenize to many more): an answer already at its budget is saved as 'length'."""
    async with AsyncExitStack() as stack:
        # A lease long enough that gateway 2 cannot take the job over before the budget below is written,
        # however late a busy machine lets gateway 1 renew it (at 0.6 s it sometimes lapsed first).
        g1, g2, alice, cid, first, gen = await _answer_on_the_first_of_two(stack, tmp_path, db_url, tiny_backend,
                                                                           lease_s=3.0)
        app1, app2 = g1._transport.app, g2._transport.app
        message_id = gen.message_id
        await app1.state.ctx.conversations.abandon(cid)  # its lease is still renewed: nobody takes it yet
        before = await app1.state.ctx.hot.logs.events(message_id)
        record = await app1.state.ctx.hot.jobs.holder(cid)
        record.spec["max_tokens"] = before[-1].answer_tokens  # as if the answer had just reached its budget
        await app1.state.ctx.hot.jobs.update(record)
        await app1.state.ctx.hot.keeper.close()
        rest = await _resume_on(g2, cid, alice, before[-1].id)
        assert [int(e.id) for e in rest] == [before[-1].id + 1]
        done = rest[0].data
        assert done["done"] is True and done["finish_reason"] == "length", rest
        saved = (await g2.get(f"/conversations/{cid}", headers=alice)).json()["messages"][-1]
        assert saved["id"] == message_id and saved["finish_reason"] == "length"
        assert saved["text"] == "".join(e.data.get("token", "") for e in before)
        assert await app2.state.ctx.hot.jobs.holder(cid) is None
        first.cancel()


async def test_a_taken_over_answer_already_ended_elsewhere_closes_its_stream(tmp_path, db_url, tiny_backend):
    """A job whose answer a sweep marked interrupted meanwhile is not continued; its stream still ends."""
    async with AsyncExitStack() as stack:
        g1, g2, alice, cid, first, gen = await _answer_on_the_first_of_two(stack, tmp_path, db_url, tiny_backend)
        app1 = g1._transport.app
        message_id = gen.message_id
        await app1.state.ctx.conversations.abandon(cid)
        await mark_interrupted(app1.state.ctx.db, [message_id], "the test's sweep")
        await app1.state.ctx.hot.keeper.close()
        before = await app1.state.ctx.hot.logs.events(message_id)
        rest = await _resume_on(g2, cid, alice, before[-1].id)  # before the fix: waited forever
        assert rest[-1].data["done"] is True and rest[-1].data["status"] == "interrupted", rest
        saved = (await g2.get(f"/conversations/{cid}", headers=alice)).json()["messages"][-1]
        assert saved["status"] == "interrupted"
        first.cancel()


async def test_the_end_another_gateway_writes_reports_the_tokens_generated(tmp_path, db_url):
    """An answer saved by its gateway, whose log that gateway could not end (the job was taken over
    meanwhile): the gateway that ends the log reports the tokens generated and metered, not a re-count
    of the saved text (a random model's text re-tokenizes to more tokens)."""
    async with AsyncExitStack() as stack:
        g1, _ = await gateways(stack, tmp_path, db_url, require_redis(), ScriptedBackend())
        app1 = g1._transport.app
        alice = await signup(g1, "alice")
        cid = await new_conversation(g1, alice)
        async with app1.state.ctx.db.session() as s:
            q = await Messages(s).add(cid, None, "user", "tell me", 2)
            a = await Messages(s).add(cid, q.id, "assistant", "a saved answer", 20, "scripted", status="complete")
            a.finish_reason, a.prompt_tokens, a.completion_tokens = "stop", 5, 7
            await s.commit()
        hot = app1.state.ctx.hot
        event_log = await hot.logs.create(a.id)
        await event_log.append({"token": "a saved answer"})
        await hot.fail_job(JobRecord(cid, "gone", a.id, spec={}), "its gateway stopped", app1.state.ctx.db)
        done = (await hot.logs.events(a.id))[-1].data
        assert done["done"] is True and done["usage"] == {"prompt_tokens": 5, "completion_tokens": 7}


async def test_a_frozen_gateway_that_wakes_and_writes_does_not_leave_the_answer_hanging(tmp_path, db_url, tiny_backend):
    """After gateway 2 took the answer over, the frozen gateway wakes and logs one more piece: gateway 2,
    still the job's holder, ends the answer as failed with the text readers saw, and frees the conversation."""
    async with AsyncExitStack() as stack:
        g1, g2, alice, cid, first, gen = await _answer_on_the_first_of_two(stack, tmp_path, db_url, tiny_backend)
        app1, app2 = g1._transport.app, g2._transport.app
        message_id = gen.message_id
        await _freeze_until_taken_over(app1, app2, cid)
        logs = app1.state.ctx.hot.logs
        for _ in range(100):  # the stale writer squeezes one entry in after the newest
            newest = (await logs.events(message_id))[-1].id
            try:
                await logs.commands.xadd(logs.stream_key(message_id), {"d": '{"token": " zombie"}'}, id=f"0-{newest + 1}")
                break
            except Exception:
                continue
        rest = await _resume_on(g2, cid, alice, 0)
        assert rest[-1].event == "error" and "lost this answer" in rest[-1].data["error"]["message"], rest[-3:]
        assert [int(e.id) for e in rest] == list(range(1, len(rest) + 1))
        saved = (await g2.get(f"/conversations/{cid}", headers=alice)).json()["messages"][-1]
        assert saved["status"] == "error" and " zombie" in saved["text"]
        assert saved["text"] == "".join(e.data.get("token", "") for e in rest)
        assert await app2.state.ctx.hot.jobs.holder(cid) is None
        first.cancel()


async def test_a_frozen_gateway_that_wakes_cannot_write_to_a_taken_over_answer(tmp_path, db_url, tiny_backend):
    """The frozen gateway wakes after gateway 2 took the answer over and tries to log one more piece
    through its own log: the log refuses it, and gateway 2's continuation ends normally."""
    async with AsyncExitStack() as stack:
        g1, g2, alice, cid, first, gen = await _answer_on_the_first_of_two(stack, tmp_path, db_url, tiny_backend)
        app1, app2 = g1._transport.app, g2._transport.app
        await _freeze_until_taken_over(app1, app2, cid)
        with pytest.raises(LogTakenOver):
            await gen.log.inner.append({"token": " zombie"})
        rest = await _resume_on(g2, cid, alice, 0)
        assert rest[-1].data.get("done") is True, rest[-3:]
        assert [int(e.id) for e in rest] == list(range(1, len(rest) + 1))
        saved = (await g2.get(f"/conversations/{cid}", headers=alice)).json()["messages"][-1]
        assert saved["status"] == rest[-1].data["status"] and " zombie" not in saved["text"]
        assert saved["text"] == "".join(e.data.get("token", "") for e in rest)
        first.cancel()


async def test_an_answer_that_cannot_be_continued_is_saved_as_failed(tmp_path, db_url):
    backend = ScriptedBackend(WORDS, delay_s=0.05)  # no tokenizer: nothing to continue with
    async with AsyncExitStack() as stack:
        g1, g2 = await gateways(stack, tmp_path, db_url, require_redis(), backend, shared_state={"job_lease_s": 0.6}, sampling={"max_tokens": 100})
        app1 = g1._transport.app
        alice = await signup(g1, "alice")
        cid = await new_conversation(g1, alice)
        first = asyncio.create_task(g1.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hi"}))
        for _ in range(500):
            gen = app1.state.ctx.conversations.running(cid)
            if gen is not None and len(await app1.state.ctx.hot.logs.events(gen.message_id)) >= 3:
                break
            await asyncio.sleep(0.01)
        await app1.state.ctx.hot.keeper.close()
        await app1.state.ctx.conversations.abandon(cid)
        r = await g2.get(f"/conversations/{cid}/stream", headers={**alice, "Last-Event-ID": "3"})
        events = parse_sse(r.text)
        assert events[-1].event == "error" and events[-1].data["error"]["code"] == "gateway_lost"
        saved = (await g2.get(f"/conversations/{cid}", headers=alice)).json()["messages"][-1]
        assert saved["status"] == "error" and "could not be continued" in saved["error"]
        assert saved["text"].startswith(WORDS[0])  # what readers were shown is kept
        first.cancel()


async def test_answers_of_a_dead_writer_that_no_lease_covers_are_interrupted(tmp_path, db_url):
    """With Redis, an answer left by a process whose liveness key has expired, and whose job is gone (a
    Redis that lost its data, say), is marked interrupted with its journaled text, without waiting for
    its heartbeat to age; a living writer's answer and a leased one (the job keeper's) are left alone."""
    async with AsyncExitStack() as stack:
        g1, g2 = await gateways(stack, tmp_path, db_url, require_redis(), ScriptedBackend(), shared_state={"job_lease_s": 0.6}, recovery={"stale_s": 3600})
        app1, app2 = g1._transport.app, g2._transport.app
        alice = await signup(g1, "alice")
        cids = [await new_conversation(g1, alice) for _ in range(3)]
        ids = []
        async with app1.state.ctx.db.session() as s:
            for cid, writer in zip(cids, ["gw9/gone", app2.state.ctx.hot.jobs.instance, "gw9/gone"]):
                q = await Messages(s).add(cid, None, "user", "tell me", 2)
                a = await Messages(s).add(cid, q.id, "assistant", "", 0, "scripted", status="incomplete",
                                          writer=writer)
                await AnswerChunks(s).add([{"message_id": a.id, "kind": "text", "text": " so far", "tokens": 2}])
                ids.append(a.id)
            await s.commit()
        dead, living, leased = ids
        jobs = app1.state.ctx.hot.jobs  # gateway 1 holds the third answer's job (its keeper renews the lease)
        assert await jobs.claim(cids[2])
        await jobs.update(JobRecord(cids[2], jobs.gateway, leased))

        async def status(message_id: str) -> str:
            async with app1.state.ctx.db.session() as s:
                return (await s.get(Message, message_id, populate_existing=True)).status

        for _ in range(500):
            if await status(dead) == "interrupted":
                break
            await asyncio.sleep(0.01)
        conv = (await g2.get(f"/conversations/{cids[0]}", headers=alice)).json()
        assert conv["messages"][-1]["status"] == "interrupted" and conv["messages"][-1]["text"] == " so far"
        assert await status(living) == "incomplete" and await status(leased) == "incomplete"
        await jobs.release(cids[2])
