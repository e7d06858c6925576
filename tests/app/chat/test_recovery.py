"""Crash recovery in-process (chatloom/app/chat/recovery.py): checkpoints while streaming, the sweep of
answers left by a dead process, the drain on shutdown, continuing from the saved text.
(The same with a real `chatloom serve` process and SIGKILL: test_crash_recovery.py.)"""
from __future__ import annotations

import asyncio
from datetime import timedelta

from sqlalchemy import update

from chatloom.app.chat.recovery import SHUT_DOWN, drain
from chatloom.store import Message, Messages
from chatloom.store.models import utcnow

from app_testing import RecordingBackend, app_client, make_settings, new_conversation, parse_sse, tokens_of
from traffic_testing import ScriptedBackend

WORDS = [f" w{i}" for i in range(60)]


async def _message(app, message_id) -> Message:
    async with app.state.ctx.db.session() as s:
        return await s.get(Message, message_id)


async def test_the_text_so_far_reaches_the_database_while_streaming(tmp_path):
    backend = ScriptedBackend(WORDS, delay_s=0.05)  # 3 s for the whole answer
    settings = make_settings(tmp_path, checkpoint_interval_s=0.3, default_max_tokens=100, moderation="off")
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        sending = asyncio.create_task(client.post(f"/conversations/{cid}/messages", headers=alice,
                                                  json={"text": "go"}))
        await asyncio.sleep(0.3)
        gen = app.state.ctx.conversations.running(cid)
        seen = []
        for _ in range(6):
            await asyncio.sleep(0.35)
            m = await _message(app, gen.message_id)
            seen.append((m.text, m.heartbeat))
        # Every ~0.35 s the saved text had grown, and it always was a prefix of the answer.
        answer = "".join(WORDS)
        texts = [t for t, _ in seen]
        assert all(answer.startswith(t) for t in texts) and texts[-1]
        assert len({t for t in texts}) >= 4, texts
        assert all(hb is not None for _, hb in seen)
        r = await sending
        m = await _message(app, gen.message_id)
        assert m.status == "incomplete" or m.status == "complete"
        assert m.text == answer and tokens_of(parse_sse(r.text)) == answer


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
    settings = make_settings(tmp_path, recovery_stale_s=1.0, moderation="off")
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
    settings = make_settings(tmp_path, recovery_stale_s=0.5, moderation="off")
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
    settings = make_settings(tmp_path, checkpoint_interval_s=0.2, default_max_tokens=100, moderation="off")
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
