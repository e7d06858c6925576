"""Crash recovery in-process (chatloom/app/chat/recovery.py, answer_journal.py): streamed text in the database
before readers get it, the sweep of answers left by a dead process (at once on a restart alone), the
drain on shutdown, continuing from the saved text.
(The same with a real `chatloom serve` process and SIGKILL: test_crash_recovery.py.)"""
from __future__ import annotations

import asyncio
from datetime import timedelta

import httpx
from sqlalchemy import select, update

from chatloom.app.main import create_app

from chatloom.app.chat.recovery import SHUT_DOWN, drain
from chatloom.store import AnswerChunk, AnswerChunks, Message, Messages, User
from chatloom.store.models import utcnow

from app_testing import RecordingBackend, app_client, make_settings, new_conversation, parse_sse, tokens_of
from traffic_testing import ScriptedBackend

WORDS = [f" w{i}" for i in range(60)]


async def _message(app, message_id) -> Message:
    async with app.state.ctx.db.session() as s:
        return await s.get(Message, message_id)


async def _stored_text(app, message_id) -> str:
    """The answer's text as a restart would find it: the message's text and its journaled chunks."""
    async with app.state.ctx.db.session() as s:
        text = await s.scalar(select(Message.text).where(Message.id == message_id))
        chunks = await s.scalars(select(AnswerChunk.text).where(AnswerChunk.message_id == message_id,
                                                                 AnswerChunk.kind == "text").order_by(AnswerChunk.id))
        return text + "".join(chunks)


async def test_every_streamed_piece_is_in_the_database_before_a_reader_gets_it(tmp_path):
    backend = ScriptedBackend(WORDS, delay_s=0.01)
    settings = make_settings(tmp_path, sampling={"max_tokens": 100}, moderation={"mode": "off"})
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        service = app.state.ctx.conversations
        sending = asyncio.create_task(client.post(f"/conversations/{cid}/messages", headers=alice,
                                                  json={"text": "go"}))
        while service.running(cid) is None:
            await asyncio.sleep(0.005)
        gen = service.running(cid)
        seen, checks = "", 0
        async for ev in gen.log.read(0):
            if ev is not None and "token" in ev.data:
                seen += ev.data["token"]
                # Checked the moment the piece is readable: a process killed now keeps all of it.
                assert (await _stored_text(app, gen.message_id)).startswith(seen)
                checks += 1
        answer = "".join(WORDS)
        assert seen == answer and checks >= 10
        r = await sending
        m = await _message(app, gen.message_id)
        assert m.status == "complete" and m.text == answer and tokens_of(parse_sse(r.text)) == answer
        assert m.tokens == len(WORDS)
        async with app.state.ctx.db.session() as s:  # the journal's rows were folded into the message
            assert not list(await s.scalars(select(AnswerChunk.id).where(AnswerChunk.message_id == m.id)))
        # Pieces were batched: fewer commits than pieces is allowed, more never.
        assert 0 < service.journal.commits <= len(WORDS)


async def test_pieces_of_answers_streaming_together_share_commits(tmp_path):
    backend = ScriptedBackend(WORDS, delay_s=0.0)  # pieces come faster than commits: they must share them
    settings = make_settings(tmp_path, sampling={"max_tokens": 100}, moderation={"mode": "off"}, accounts={"auth_cache_s": 0})
    async with app_client(settings, backend) as (client, app, alice):
        cids = [await new_conversation(client, alice) for _ in range(4)]
        await _set_tier(app, "pro")
        replies = await asyncio.gather(*(client.post(f"/conversations/{c}/messages", headers=alice,
                                                     json={"text": "go"}) for c in cids))
        assert all(tokens_of(parse_sse(r.text)) == "".join(WORDS) for r in replies), [r.text[-400:] for r in replies]
        # 4 answers x 60 pieces: written together, in far fewer transactions than pieces.
        assert app.state.ctx.conversations.journal.commits < 4 * len(WORDS) / 2


async def _set_tier(app, tier: str) -> None:
    async with app.state.ctx.db.session() as s:
        await s.execute(update(User).values(tier=tier))
        await s.commit()


async def _stale_answer(app, cid: str, text: str, stale_s: float = 60) -> str:
    """An answer in progress whose writer stopped beating `stale_s` ago (as a killed process leaves it)."""
    async with app.state.ctx.db.session() as s:
        q = await Messages(s).add(cid, None, "user", "tell me", 2)
        a = await Messages(s).add(cid, q.id, "assistant", text, len(text.split()), "scripted", status="incomplete")
        await s.execute(update(Message).where(Message.id == a.id)
                        .values(heartbeat=utcnow() - timedelta(seconds=stale_s)))
        await s.commit()
        return a.id


async def test_answers_left_by_a_dead_process_are_interrupted_and_can_be_continued(tmp_path):
    backend = RecordingBackend(ScriptedBackend([" and", " then", " the", " end."]))
    settings = make_settings(tmp_path, recovery={"stale_s": 1.0}, moderation={"mode": "off"})
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        fresh = await _stale_answer(app, cid, "still being written", stale_s=0)
        stale = await _stale_answer(app, cid, "Once upon a time", stale_s=60)
        for _ in range(40):  # the periodic sweep (every half stale period) finds it
            if (await _message(app, stale)).status == "interrupted":
                break
            await asyncio.sleep(0.1)
        m = await _message(app, stale)
        assert m.status == "interrupted" and m.text == "Once upon a time" and "stopped" in m.interrupted_reason
        conv = (await client.get(f"/conversations/{cid}?leaf={stale}", headers=alice)).json()
        out = conv["messages"][-1]
        assert out["status"] == "interrupted" and out["interrupted_reason"]

        r = await client.post(f"/conversations/{cid}/messages/{stale}/continue", headers=alice, json={})
        assert r.status_code == 200, r.text
        events = parse_sse(r.text)
        assert tokens_of(events) == "Once upon a time and then the end."
        done = events[-1].data
        assert done["message_id"] == stale and done["status"] == "complete"
        m = await _message(app, stale)
        assert m.text == "Once upon a time and then the end." and m.status == "complete"
        assert m.interrupted_reason is None
        # The model was asked to go on from the saved text, as the start of its own turn.
        req = backend.answers()[-1]
        assert req.continue_final and req.messages[-1] == {"role": "assistant", "content": "Once upon a time"}
        # A complete answer cannot be continued; an answer still beating was left alone until it goes stale.
        r = await client.post(f"/conversations/{cid}/messages/{stale}/continue", headers=alice, json={})
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_continuable"
        assert (await _message(app, fresh)).status in ("incomplete", "interrupted")


async def test_regenerating_an_interrupted_answer_makes_a_sibling(tmp_path):
    settings = make_settings(tmp_path, recovery={"stale_s": 0.5}, moderation={"mode": "off"})
    async with app_client(settings, ScriptedBackend()) as (client, app, alice):
        cid = await new_conversation(client, alice)
        stale = await _stale_answer(app, cid, "half an ans", stale_s=60)
        for _ in range(40):
            if (await _message(app, stale)).status == "interrupted":
                break
            await asyncio.sleep(0.1)
        r = await client.post(f"/conversations/{cid}/messages/{stale}/regenerate", headers=alice)
        assert r.status_code == 200
        done = parse_sse(r.text)[-1].data
        assert done["message_id"] != stale and done["status"] == "complete"
        assert (await _message(app, stale)).status == "interrupted"


async def test_shutdown_drains_then_interrupts_what_is_left(tmp_path):
    backend = ScriptedBackend(WORDS, delay_s=0.05)
    settings = make_settings(tmp_path, sampling={"max_tokens": 100}, moderation={"mode": "off"})
    async with app_client(settings, backend) as (client, app, alice):
        short_cid = await new_conversation(client, alice)
        long_cid = await new_conversation(client, alice)
        service = app.state.ctx.conversations
        quick = asyncio.create_task(client.post(f"/conversations/{short_cid}/messages", headers=alice,
                                                json={"text": "go", "max_tokens": 4}))
        slow = asyncio.create_task(client.post(f"/conversations/{long_cid}/messages", headers=alice,
                                               json={"text": "go"}))
        await asyncio.sleep(0.1)
        quick_id = service.running(short_cid).message_id
        slow_id = service.running(long_cid).message_id
        await drain(service, 0.8)  # the short answer finishes within the deadline; the long one cannot
        await asyncio.gather(quick, slow)
        q, s = await _message(app, quick_id), await _message(app, slow_id)
        assert q.status == "incomplete" and q.finish_reason == "length"  # finished normally (4 tokens)
        assert s.status == "interrupted" and s.interrupted_reason == SHUT_DOWN
        assert s.text and "".join(WORDS).startswith(s.text) and len(s.text) < len("".join(WORDS))


async def _in_progress_answer(app, cid: str, writer: str | None, chunks: list[str]) -> str:
    """An answer in progress as a process that died mid-answer leaves it: a fresh heartbeat, its
    text in journaled chunks."""
    async with app.state.ctx.db.session() as s:
        q = await Messages(s).add(cid, None, "user", "tell me", 2)
        a = await Messages(s).add(cid, q.id, "assistant", "", 0, "scripted", status="incomplete", writer=writer)
        await AnswerChunks(s).add([{"message_id": a.id, "kind": "text", "text": c, "tokens": 1} for c in chunks])
        await s.commit()
        return a.id


async def test_a_restart_alone_marks_the_previous_process_answers_at_once(tmp_path):
    # A stale period far beyond the test: only the writer's id can tell the answer was left behind.
    settings = make_settings(tmp_path, recovery={"stale_s": 3600}, moderation={"mode": "off"})
    async with app_client(settings, ScriptedBackend()) as (client, app, alice):
        cid = await new_conversation(client, alice)
        left = await _in_progress_answer(app, cid, "gw/dead-process", [" Once", " upon", " a"])
        own = await _in_progress_answer(app, cid, app.state.ctx.conversations.jobs.instance, [" x"])
    app = create_app(settings, ScriptedBackend())  # the restart, on the same database
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post("/auth/login", json={"username": "alice", "password": "correct horse"})
        alice = {"Authorization": f"Bearer {r.json()['token']}"}
        # The first read after the start: no sweep period to wait for.
        conv = (await client.get(f"/conversations/{cid}?leaf={left}", headers=alice)).json()
        answer = conv["messages"][-1]
        assert answer["id"] == left and answer["status"] == "interrupted" and answer["interrupted_reason"]
        assert answer["text"] == " Once upon a"
        m = await _message(app, left)
        assert m.tokens == 3
        # The previous process's own answers too: a new process has a new instance id.
        assert (await _message(app, own)).status == "interrupted"
        async with app.state.ctx.db.session() as s:
            assert not list(await s.scalars(select(AnswerChunk.id)))
        r = await client.post(f"/conversations/{cid}/messages/{left}/continue", headers=alice, json={})
        assert r.status_code == 200 and parse_sse(r.text)[-1].data["status"] == "complete"
        m = await _message(app, left)
        assert m.text == " Once upon aHello there, friend." and m.status == "complete"


async def test_a_sweep_during_an_outage_logs_one_line_and_the_next_one_runs(caplog):
    """Redis or the database away: the sweep is skipped with one warning line (no traceback in the log
    every half second), and the loop sweeps again."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from redis.exceptions import ConnectionError as RedisConnectionError

    from chatloom.app.chat.recovery import Sweeper

    settings = SimpleNamespace(recovery=SimpleNamespace(stale_s=1.0), shared_state=SimpleNamespace(job_lease_s=0.5))
    sweeper = Sweeper(SimpleNamespace(settings=settings), alone=False)
    calls = []

    async def sweep(at_start: bool = False):
        calls.append(at_start)
        if len(calls) == 1:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379")
        return []

    sweeper.sweep = sweep
    with caplog.at_level(logging.WARNING, logger="chatloom.app.chat.recovery"):
        await sweeper.start()
        for _ in range(100):
            if len(calls) >= 2:
                break
            await asyncio.sleep(0.05)
        await sweeper.stop()
    assert len(calls) >= 2
    (record,) = [r for r in caplog.records if "sweep" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "ConnectionError" in record.getMessage()
