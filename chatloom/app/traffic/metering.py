"""Metering: tokens per user, UTC day and model, written to the database as generations end.

One writer task per process owns the writes: records queue in memory, summed per (user, day, model),
and each flush adds them in one transaction. So metering holds one database connection at a time
(SQLite gets one metering writer, and a burst of answers ending together cannot empty the pool).

A flush that follows another back to back (records arrived while the first ran) starts `flush_gap_s`
after it at the earliest (`traffic.metering_flush_gap_ms`, 50 ms). A record arriving in a quiet
moment is written at once; when hundreds of answers end within a few seconds, each flush carries
what ended since the last one. Back-to-back flushes wrote one to three records per transaction, about
70 transactions a second at 1,000 ending streams, each taking 1.5 ms of CPU from a gateway that is
relaying every other stream's tokens meanwhile.

A failed flush (database locked, pool timeout, database restarting) keeps its records and retries
with backoff. close() flushes what is queued before the database is closed. A conversation answer's
tokens skip the queue: `write` adds them in the transaction that saves the answer
(chat/final_save.py)."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.pool import NullPool

from chatloom.serving import Usage
from chatloom.store import Database, UsageRows

log = logging.getLogger(__name__)

Key = tuple[str, str, str]  # (user id, UTC day, model)


def utc_day(ts: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if ts is None else ts, timezone.utc).strftime("%Y-%m-%d")


@dataclass
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, other: Tally) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens


class Meter:
    """Usage rows, written by one background task. `wait_s`: how long record() waits for its flush
    (so a caller usually reads its own usage back at once) before it returns and leaves the record
    queued; `backoff_s`: the first and the longest pause between failed flushes; `flush_gap_s`: the
    least time from one flush's start to the next one's."""

    def __init__(self, db: Database, wait_s: float = 5.0, backoff_s: tuple[float, float] = (0.05, 2.0),
                 flush_gap_s: float = 0.05) -> None:
        self.db = db
        self.wait_s = wait_s
        self.backoff_s = backoff_s
        self.flush_gap_s = flush_gap_s
        self.flushes = 0  # transactions begun by the writer (for logs and tests)
        self._flushed_at = -math.inf  # when the last flush began (time.monotonic)
        self._hurry = False  # close() has begun: the writer skips what is left of the gap
        self._gap_end: asyncio.Future[None] | None = None  # the writer waiting out the gap; close() ends it
        self._pending: dict[Key, Tally] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self._task: asyncio.Task[None] | None = None
        self.failed_flushes = 0  # flushes that raised and were retried (for logs and tests)
        self._floors: dict[tuple[str, str], asyncio.Future[Tally]] = {}
        self._reader: AsyncEngine | None = None

    @property
    def queued(self) -> int:
        """Requests recorded but not yet in the database."""
        return sum(t.requests for t in self._pending.values())

    async def record(self, user_id: str, model: str, usage: Usage) -> None:
        """Add one request's tokens. Never raises and never waits longer than `wait_s`: metering must
        not break or hold up an answer; a record not written by then stays queued."""
        self._merge({(user_id, utc_day(), model): Tally(1, usage.prompt_tokens, usage.completion_tokens,
                                                         usage.cached_tokens)})
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(done)
        task = self._task
        # A new writer where none runs in this event loop (an app served by several loops in turn).
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._task = asyncio.create_task(self._run(), name="metering-writer")
        # asyncio.wait, not wait_for over a shield: on Python 3.11 that swallows a cancellation of the
        # caller arriving as the write ends (a stopped batch line then ran on into the next one).
        await asyncio.wait({done}, timeout=self.wait_s)

    @staticmethod
    async def write(session: AsyncSession, user_id: str, model: str, usage: Usage) -> None:
        """Add one request's tokens inside the caller's transaction instead of the queue: committed or
        rolled back with it (an answer's final save, so that only the process that saves it meters it)."""
        await UsageRows(session).add(user_id, utc_day(), model, usage.prompt_tokens, usage.completion_tokens,
                                     usage.cached_tokens)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued (at shutdown, before the database closes). Records still unwritten after
        `timeout_s` are logged as lost."""
        loop = asyncio.get_running_loop()
        task = self._task
        self._hurry = True
        if self._gap_end is not None and not self._gap_end.done() and self._gap_end.get_loop() is loop:
            self._gap_end.set_result(None)
        if self._pending and (task is None or task.done() or task.get_loop() is not loop):
            task = self._task = asyncio.create_task(self._run(), name="metering-writer")
        if task is not None and not task.done() and task.get_loop() is loop:
            await asyncio.wait({task}, timeout=timeout_s)
            if not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        if self._pending:
            for (user_id, day, model), t in self._pending.items():
                log.error("could not meter usage for %s (%s, %s) before shutdown: %d requests, %d+%d tokens lost",
                          user_id, day, model, t.requests, t.prompt_tokens, t.completion_tokens)
            self._pending.clear()
        self._wake(self._waiters)
        self._waiters = []
        if self._reader is not None:
            await self._reader.dispose()
            self._reader = None
        self._hurry = False  # a meter reopened in another event loop paces its flushes again

    async def charged_on(self, user_id: str, day: str, discount: float) -> int:
        """What the user's metered tokens of `day` (written, and queued here) cost the quota, cached prompt
        tokens at `discount` off: where a shared quota store that lost its counters starts the day again.
        Callers asking at once share one query; it runs on a connection of its own, outside the pool,
        which a burst of requests may hold entirely while they wait for their quota."""
        key = (user_id, day)
        task = self._floors.get(key)
        if task is None:
            task = self._floors[key] = asyncio.ensure_future(self._read_day(user_id, day))
            task.add_done_callback(lambda _t: self._floors.pop(key, None))
        tally = Tally()
        tally.add(await asyncio.shield(task))
        for (uid, d, _model), t in list(self._pending.items()):
            if uid == user_id and d == day:
                tally.add(t)
        return tally.prompt_tokens + tally.completion_tokens - math.floor(tally.cached_tokens * discount)

    async def _read_day(self, user_id: str, day: str) -> Tally:
        if self._reader is None:
            self._reader = create_async_engine(self.db.url, poolclass=NullPool)
        async with AsyncSession(self._reader) as session:
            rows = await UsageRows(session).query(user_id, since=day, until=day)
        tally = Tally()
        for row, _name in rows:
            tally.add(Tally(row.requests, row.prompt_tokens, row.completion_tokens, row.cached_tokens))
        return tally

    # -- the writer ------------------------------------------------------------------
    def _merge(self, batch: dict[Key, Tally]) -> None:
        for key, t in batch.items():
            self._pending.setdefault(key, Tally()).add(t)

    @staticmethod
    def _wake(waiters: list[asyncio.Future[None]]) -> None:
        for w in waiters:
            if not w.done() and not w.get_loop().is_closed():
                w.set_result(None)

    async def _run(self) -> None:
        delay = self.backoff_s[0]
        paced = False  # a writer's first flush goes at once: a lone record is never held up
        while self._pending:
            if paced:
                await self._gap()
            paced = True
            batch, waiters = self._pending, self._waiters
            self._pending, self._waiters = {}, []
            self._flushed_at = time.monotonic()
            self.flushes += 1
            try:
                left = await self._flush(batch)
            except asyncio.CancelledError:
                self._merge(batch)
                self._waiters += waiters
                raise
            if not left:
                delay = self.backoff_s[0]
                self._wake(waiters)
                continue
            self._merge(left)
            self._waiters += waiters
            self.failed_flushes += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_s[1])

    async def _gap(self) -> None:
        """Before a flush that follows another (records came while it ran), wait out what is left of
        `flush_gap_s` since that one began (nothing once close() has begun): more records join."""
        left = self._flushed_at + self.flush_gap_s - time.monotonic()
        if left > 0 and not self._hurry:
            self._gap_end = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait({self._gap_end}, timeout=left)
            finally:
                self._gap_end = None

    async def _flush(self, batch: dict[Key, Tally]) -> dict[Key, Tally]:
        """Write `batch`; returns what is left to retry."""
        try:
            await self._write(batch)
            return {}
        except IntegrityError:  # a row created by another process meanwhile, or one that cannot be (user gone)
            pass
        except Exception as e:
            log.warning("metering write failed, %d rows kept for a retry: %s", len(batch), e)
            return batch
        left: dict[Key, Tally] = {}
        for key, t in batch.items():
            for attempt in range(2):  # after a lost race to create the row, the UPDATE finds it
                try:
                    await self._write({key: t})
                    break
                except IntegrityError as e:
                    if attempt:
                        log.error("could not meter usage for %s: %s", key[0], e)
                except Exception as e:
                    log.warning("metering write failed, kept for a retry: %s", e)
                    left[key] = t
                    break
        return left

    async def _write(self, batch: dict[Key, Tally]) -> None:
        async with self.db.session() as session:
            rows = UsageRows(session)
            for (user_id, day, model), t in batch.items():
                await rows.add(user_id, day, model, t.prompt_tokens, t.completion_tokens, t.cached_tokens,
                               requests=t.requests)
            await session.commit()
