"""Metering under contention: answers ending together while the database is locked are all metered,
and shutdown flushes what is queued."""
from __future__ import annotations

import asyncio
import sqlite3

import httpx
import pytest
from sqlalchemy import event, func, select

from chatloom.app.main import create_app
from chatloom.app.traffic.metering import Meter
from chatloom.serving import Usage
from chatloom.store import Database
from chatloom.store.models import DailyUsage, User

from app_testing import signup


@pytest.fixture
async def db(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'meter.db'}")

    def short_busy_timeout(dbapi_connection, _record) -> None:
        # Runs after the project's tuning: a locked database fails in 20 ms instead of 10 s.
        cur = dbapi_connection.cursor()
        cur.execute("PRAGMA busy_timeout=20")
        cur.close()

    event.listen(db.engine.sync_engine, "connect", short_busy_timeout)
    await db.migrate()
    async with db.session() as s:
        s.add_all([User(id=f"usr_{i}", username=f"u{i}") for i in range(4)])
        await s.commit()
    yield db
    await db.close()


def lock(db: Database) -> sqlite3.Connection:
    """Another connection holding a write transaction: every other writer gets "database is locked"."""
    holder = sqlite3.connect(db.engine.url.database, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    return holder


async def totals(db: Database) -> tuple[int, int, int]:
    async with db.session() as s:
        row = (await s.execute(select(func.sum(DailyUsage.requests), func.sum(DailyUsage.prompt_tokens),
                                      func.sum(DailyUsage.completion_tokens)))).one()
    return tuple(v or 0 for v in row)


def usages(n: int) -> list[tuple[str, Usage]]:
    return [(f"usr_{i % 4}", Usage(prompt_tokens=10 + i, completion_tokens=i + 1)) for i in range(n)]


async def test_answers_ending_while_the_database_is_locked_are_all_metered(db):
    meter = Meter(db, wait_s=0.2, backoff_s=(0.01, 0.05))
    records = usages(60)
    holder = lock(db)
    try:
        # Each record() gives up waiting (never failing the answer) while the writer cannot write.
        await asyncio.wait_for(asyncio.gather(*(meter.record(u, "m", usage) for u, usage in records)), 10)
        assert meter.queued == 60 and meter.failed_flushes > 0
    finally:
        holder.rollback()
        holder.close()
    await meter.close()
    assert await totals(db) == (60, sum(u.prompt_tokens for _, u in records),
                                sum(u.completion_tokens for _, u in records))
    async with db.session() as s:  # summed into one row per user, day and model
        assert (await s.execute(select(func.count()).select_from(DailyUsage))).scalar_one() == 4


async def test_shutdown_flushes_queued_records(db):
    meter = Meter(db, wait_s=0.0, backoff_s=(0.01, 0.05))
    records = usages(20)
    holder = lock(db)
    try:
        for u, usage in records:
            await meter.record(u, "m", usage)
        closing = asyncio.create_task(meter.close(timeout_s=30))
        while meter.failed_flushes == 0:  # the writer has met the lock: the records wait for close()
            await asyncio.sleep(0.005)
        assert not closing.done()
    finally:
        holder.rollback()
        holder.close()
    await closing
    assert meter.queued == 0
    assert await totals(db) == (20, sum(u.prompt_tokens for _, u in records),
                                sum(u.completion_tokens for _, u in records))


async def test_a_lone_record_is_written_at_once_whatever_the_gap(db):
    meter = Meter(db, wait_s=5.0, flush_gap_s=60.0)
    for i in range(3):  # each one after the last was written: a quiet moment every time
        await asyncio.wait_for(meter.record("usr_0", "m", Usage(prompt_tokens=1, completion_tokens=2)), 10)
        assert meter.queued == 0 and meter.flushes == i + 1
    assert await totals(db) == (3, 3, 6)
    await meter.close()


async def test_records_arriving_during_a_flush_wait_out_the_gap_together(db):
    meter = Meter(db, wait_s=0.05, flush_gap_s=60.0)
    writing, release = asyncio.Event(), asyncio.Event()
    real_write = meter._write

    async def first_write_held(batch):
        if meter.flushes == 1:
            writing.set()
            await release.wait()
        await real_write(batch)

    meter._write = first_write_held
    first = asyncio.create_task(meter.record("usr_0", "m", Usage(prompt_tokens=1, completion_tokens=1)))
    await asyncio.wait_for(writing.wait(), 10)
    await meter.record("usr_1", "m", Usage(prompt_tokens=1, completion_tokens=1))  # while the first runs
    release.set()
    await first
    # The next flush waits for the gap: what ends meanwhile joins it instead of a transaction each.
    for u in ("usr_2", "usr_3", "usr_1"):
        await meter.record(u, "m", Usage(prompt_tokens=1, completion_tokens=1))
    assert meter.flushes == 1 and meter.queued == 4
    await asyncio.wait_for(meter.close(), 10)  # shutdown does not wait for the gap
    assert meter.flushes == 2 and meter.queued == 0 and await totals(db) == (5, 5, 5)


async def test_close_gives_up_at_its_deadline_when_the_database_stays_locked(db, caplog):
    meter = Meter(db, wait_s=0.0, backoff_s=(0.01, 0.05))
    holder = lock(db)
    try:
        await meter.record("usr_0", "m", Usage(prompt_tokens=3, completion_tokens=4))
        await asyncio.wait_for(meter.close(timeout_s=0.3), 10)
    finally:
        holder.rollback()
        holder.close()
    assert meter.queued == 0 and "could not meter usage for usr_0" in caplog.text
    assert await totals(db) == (0, 0, 0)


async def test_a_row_that_cannot_be_written_does_not_hold_up_the_others(db, caplog):
    meter = Meter(db, wait_s=5.0)
    await asyncio.gather(meter.record("usr_gone", "m", Usage(prompt_tokens=5, completion_tokens=5)),
                         meter.record("usr_1", "m", Usage(prompt_tokens=7, completion_tokens=2)))
    await meter.close()
    assert await totals(db) == (1, 7, 2)
    assert "could not meter usage for usr_gone" in caplog.text


async def test_the_app_flushes_queued_usage_at_shutdown(settings, tiny_backend):
    app = create_app(settings, tiny_backend)
    gate = asyncio.Event()
    async with app.router.lifespan_context(app):
        ctx = app.state.ctx
        meter, moderator = ctx.traffic.meter, ctx.traffic.moderator
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            me = (await client.get("/auth/me", headers=await signup(client, "dave"))).json()
        write, close = meter._write, moderator.close

        async def gated_write(batch):  # the write can start only once shutdown has begun
            await gate.wait()
            await write(batch)

        async def close_then_open_gate():
            await close()
            gate.set()

        writing_at_db_close: list[bool] = []
        db_close = ctx.db.close

        async def note_then_close_db():
            writing_at_db_close.append(not meter._task.done())
            await db_close()

        meter._write, moderator.close, meter.wait_s = gated_write, close_then_open_gate, 0.0
        ctx.db.close = note_then_close_db
        await meter.record(me["id"], "tiny-random", Usage(prompt_tokens=11, completion_tokens=13))
        assert await totals(ctx.db) == (0, 0, 0)  # still queued behind the gate
    assert writing_at_db_close == [False]  # the queue was flushed before the database closed
    db = Database(settings.server.db_url)
    try:
        assert await totals(db) == (1, 11, 13)
    finally:
        await db.close()


async def test_a_caller_cancelled_as_its_record_is_written_stays_cancelled(db):
    """The write ending and the caller's cancellation in one turn of the loop: the caller still ends
    cancelled (a stopped batch line must not run on into the next line)."""
    meter = Meter(db, wait_s=5.0)
    never = asyncio.Event()
    meter._run = never.wait  # no writer: the test ends the record's wait itself
    task = asyncio.create_task(meter.record("usr_0", "m", Usage(prompt_tokens=3, completion_tokens=2)))
    while not meter._waiters:
        await asyncio.sleep(0)
    await asyncio.sleep(0)  # into its wait
    meter._waiters[0].set_result(None)  # written ...
    task.cancel()  # ... and cancelled in the same turn
    with pytest.raises(asyncio.CancelledError):
        await task
