"""The fenced final save of an answer (chat/final_save.py), on SQLite and PostgreSQL: the answer's outcome
and its usage row are written together, and only by the process that still writes the answer."""
from __future__ import annotations

import asyncio
import sqlite3

import pytest
from sqlalchemy import event, func, select

from chatloom.app.chat.final_save import GONE, LOST, SAVED, UNSAVED, Metered, save_answer
from chatloom.app.chat.recovery import interrupt
from chatloom.serving import Usage
from chatloom.store import AnswerChunks, Conversations, Database, Messages, Users
from chatloom.store.models import AnswerChunk, DailyUsage, Message

A, B = "gw1/aaaa", "gw2/bbbb"  # two gateway processes' instance ids
DONE = {"text": "the whole answer", "tokens": 3, "status": "complete", "finish_reason": "stop", "prompt_tokens": 7}


@pytest.fixture
async def db(db_url):
    db = Database(db_url)
    await db.migrate()
    yield db
    await db.close()


async def running_answer(db: Database, writer: str = A, username: str = "alice") -> tuple[str, str, Metered]:
    """A conversation whose answer `writer` is writing, with one journaled chunk."""
    async with db.session() as s:
        user = await Users(s).create(username, None)
        conv = await Conversations(s).create(user.id)
        question = await Messages(s).add(conv.id, None, "user", "hi", 1)
        answer = await Messages(s).add(conv.id, question.id, "assistant", "", 0, status="incomplete", writer=writer)
        await AnswerChunks(s).add([{"message_id": answer.id, "kind": "text", "text": "the whole", "tokens": 2}])
        await s.commit()
        return conv.id, answer.id, Metered(user.id, "m", Usage(prompt_tokens=7, completion_tokens=3))


async def state(db: Database, message_id: str) -> tuple[Message | None, int, int]:
    """The message, the requests metered and the chunks left."""
    async with db.session() as s:
        message = await s.get(Message, message_id)
        requests = await s.scalar(select(func.coalesce(func.sum(DailyUsage.requests), 0)))
        chunks = await s.scalar(select(func.count()).select_from(AnswerChunk).where(AnswerChunk.message_id == message_id))
    return message, requests, chunks


async def test_the_writer_saves_and_meters_in_one_go(db):
    cid, mid, metered = await running_answer(db)
    assert await save_answer(db, mid, cid, A, DONE, metered) == SAVED
    message, requests, chunks = await state(db, mid)
    assert (message.text, message.status, requests, chunks) == ("the whole answer", "complete", 1, 0)
    async with db.session() as s:
        row = await s.scalar(select(DailyUsage))
    assert (row.prompt_tokens, row.completion_tokens) == (7, 3)
    assert await save_answer(db, mid, cid, A, DONE, metered) == LOST  # saved once: a second save is a loser's
    assert (await state(db, mid))[1] == 1


async def test_a_writer_whose_answer_was_taken_over_writes_nothing(db):
    cid, mid, metered = await running_answer(db)
    async with db.session() as s:  # gateway 2 takes the answer over
        assert await Messages(s).claim(mid, B, text="the whole")
        await s.commit()
    assert await save_answer(db, mid, cid, A, DONE, metered) == LOST
    message, requests, _ = await state(db, mid)
    assert (message.text, message.status, message.finish_reason, message.writer) == ("the whole", "incomplete", None, B)
    assert requests == 0
    assert await save_answer(db, mid, cid, B, DONE, metered) == SAVED  # the one that took it over saves it
    assert (await state(db, mid))[1] == 1


async def test_an_answer_saved_by_its_writer_cannot_be_taken_over(db):
    cid, mid, metered = await running_answer(db)
    assert await save_answer(db, mid, cid, A, DONE, metered) == SAVED
    async with db.session() as s:
        assert not await Messages(s).claim(mid, B, text="the whole")
        await s.commit()
    message, requests, _ = await state(db, mid)
    assert (message.writer, message.text, requests) == (A, "the whole answer", 1)


async def test_an_answer_a_sweep_took_for_abandoned_is_still_its_writers(db):
    """A sweep that found the writer's liveness key gone (Redis lost it) marked the answer interrupted while
    the writer still ran it: nobody else writes it, so the writer's save replaces the interrupted outcome."""
    cid, mid, metered = await running_answer(db)
    assert await interrupt(db, [mid]) == [mid]
    assert await save_answer(db, mid, cid, A, {**DONE, "interrupted_reason": None}, metered) == SAVED
    message, requests, chunks = await state(db, mid)
    assert (message.status, message.interrupted_reason, message.text, requests) == ("complete", None,
                                                                                     "the whole answer", 1)


async def test_a_deleted_answer_is_gone_and_nothing_is_written(db):
    cid, mid, metered = await running_answer(db)
    async with db.session() as s:
        await Conversations(s).delete(cid)
        await s.commit()
    assert await save_answer(db, mid, cid, A, DONE, metered) == GONE
    assert (await state(db, mid))[1] == 0


async def test_a_locked_database_is_waited_out(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'locked.db'}")

    def short_busy_timeout(dbapi_connection, _record) -> None:  # a locked database fails in 20 ms, not 10 s
        cur = dbapi_connection.cursor()
        cur.execute("PRAGMA busy_timeout=20")
        cur.close()

    event.listen(db.engine.sync_engine, "connect", short_busy_timeout)
    await db.migrate()
    try:
        cid, mid, metered = await running_answer(db)
        holder = sqlite3.connect(db.engine.url.database, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        saving = asyncio.create_task(save_answer(db, mid, cid, A, DONE, metered))
        await asyncio.sleep(0.3)
        assert not saving.done()  # retrying, not failed
        holder.rollback()
        holder.close()
        assert await asyncio.wait_for(saving, 10) == SAVED
        assert (await state(db, mid))[1] == 1
        cid, mid, metered = await running_answer(db, username="bob")
        holder = sqlite3.connect(db.engine.url.database, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:  # locked for longer than the save waits: nothing written, and it says so
            assert await save_answer(db, mid, cid, A, DONE, metered, retry_s=0.2) == UNSAVED
        finally:
            holder.rollback()
            holder.close()
        message, requests, _ = await state(db, mid)
        assert (message.status, message.finish_reason, requests) == ("incomplete", None, 1)
    finally:
        await db.close()
