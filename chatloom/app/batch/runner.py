"""Runs batches: every gateway has one runner, and each active batch is run by the gateway holding its lease.

Every `poll_s` (or at once when a batch is created or cancelled here) the runner looks for active batches
that are free, whose lease lapsed, or whose holder is a dead process (`alive`, as answers' writers are
judged), claims them (store/batches.py: one conditional UPDATE) and runs each through its statuses:

    validating   the input file read into one row per line (lines.py); bad lines failed at once
    in_progress  pending lines run, `concurrency` at a time (and one fewer than the user's tier may run at
                 once, leaving them one for interactive use), each through its Endpoint in the batch
                 class; a line's result is written when it ends. 429s (the user's quota, counted at the
                 discount) and 503s wait and run again; other refusals go to the error file
    finalizing   the output and error files written (results.py)
    cancelling   running lines stopped, then the files of what ended, and `cancelled`

A batch past its window is `expired`: its lines still pending go to the error file as batch_expired. The
lease is renewed every `lease_s / 3`; a runner that loses it stops its copy, and one that shuts down lets
its leases go so another gateway continues at once.
"""
from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta, timezone
from typing import Awaitable, Callable, Mapping

from sqlalchemy import delete, update
from sqlalchemy.exc import DBAPIError

from chatloom.app.batch import results
from chatloom.app.batch.ended import Ended
from chatloom.app.batch.lines import Endpoint, InputError, parse
from chatloom.app.core.errors import ApiError
from chatloom.app.state.background import cancel_requested, stop_loop
from chatloom.app.traffic import batch_class
from chatloom.settings import Settings
from chatloom.store import Database, User
from chatloom.store.batches import Batch, BatchLine, Batches
from chatloom.store.blobs import BlobNotFound, BlobStore
from chatloom.store.models import StoredFile

log = logging.getLogger(__name__)

WAIT_AGAIN = {429, 503}  # a busy service or a spent quota: the line waits and runs again
LINE_ROWS_PER_COMMIT = 1000


def now() -> datetime:
    return datetime.now(timezone.utc)


class LeaseLost(Exception):
    """Another gateway holds the batch now: this runner's copy stops."""


class BatchRunner:
    def __init__(self, db: Database, blobs: BlobStore, settings: Settings, endpoints: Mapping[str, Endpoint],
                 instance: str, alive: Callable[[set[str]], Awaitable[set[str]]],
                 user_slots: Callable[[User], int] = lambda user: 1_000_000,
                 quiet: Callable[[], Awaitable[None]] | None = None) -> None:
        self.db = db
        self.blobs = blobs
        self.settings = settings.batch
        self.endpoints = endpoints
        self.instance = instance  # this process's id (unique per start)
        self.alive = alive
        self.user_slots = user_slots  # the most generations a user may run at once (their tier's)
        # Returns once no interactive request is starting (admission's until_interactive_started).
        self.quiet = quiet or _at_once
        self._loop_task: asyncio.Task | None = None
        self._running: dict[str, asyncio.Task] = {}
        self._wake = asyncio.Event()
        self._poke = asyncio.Event()  # replaced at each nudge: whoever waits on the old one wakes

    # -- the loop ------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="batch-runner")

    def nudge(self) -> None:
        """Look for work now (a batch was created or cancelled on this gateway)."""
        self._wake.set()
        self._poke.set()
        self._poke = asyncio.Event()

    async def close(self) -> None:
        """Stop: running lines are stopped and the leases let go, so another gateway goes on at once."""
        await stop_loop(self._loop_task)
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except (DBAPIError, OSError) as exc:  # the database away: try again next time
                log.warning("looking for batches to run skipped: %s: %s", type(exc).__name__, exc)
            except Exception:
                log.exception("looking for batches to run")
            try:
                async with asyncio.timeout(self.settings.poll_s):
                    await self._wake.wait()
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def tick(self) -> None:
        """Claim and start the active batches no live gateway is running."""
        async with self.db.session() as session:
            active = await Batches(session).active()
        holders = {b.lease_holder for b in active if b.lease_holder and b.lease_holder != self.instance}
        alive = await self.alive(holders) if holders else set()
        for batch in active:
            if batch.id in self._running:
                continue
            dead = batch.lease_holder if batch.lease_holder in holders - alive else None
            until = now() + timedelta(seconds=self.settings.lease_s)
            async with self.db.session() as session:
                if not await Batches(session).claim(batch.id, self.instance, until, now(), take_from=dead):
                    continue
            if batch.lease_holder and batch.lease_holder != self.instance:
                log.warning("continuing batch %s of gateway %s", batch.id, batch.lease_holder)
            task = asyncio.create_task(self._hold(batch.id), name=f"batch-{batch.id}")
            self._running[batch.id] = task
            task.add_done_callback(lambda _t, bid=batch.id: self._running.pop(bid, None))

    # -- one batch -------------------------------------------------------------------------
    async def _hold(self, batch_id: str) -> None:
        """Run the batch while renewing its lease; let the lease go when done or stopped."""
        work = asyncio.create_task(self._run(batch_id))
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=self.settings.lease_s / 3)
                if work.done():
                    break
                async with self.db.session() as session:
                    if not await Batches(session).renew(batch_id, self.instance,
                                                        now() + timedelta(seconds=self.settings.lease_s)):
                        log.warning("lost the lease of batch %s; stopping it here", batch_id)
                        work.cancel()
                        break
            await asyncio.gather(work, return_exceptions=True)
            if not work.cancelled() and work.exception() is not None:
                log.error("batch %s: %r", batch_id, work.exception())
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            async with self.db.session() as session:
                await asyncio.shield(Batches(session).release(batch_id, self.instance))

    async def _run(self, batch_id: str) -> None:
        while True:
            batch = await self._load(batch_id)
            if batch is None or batch.status not in ("validating", "in_progress", "finalizing", "cancelling"):
                return
            if batch.status == "validating":
                await self._validate(batch)
            elif batch.status == "in_progress":
                await self._execute(batch)
            elif batch.status == "cancelling":
                await results.write_files(self.db, self.blobs, batch)
                await self._set(batch.id, status="cancelled", cancelled_at=now())
            else:
                await results.write_files(self.db, self.blobs, batch)
                ended = "expired" if batch.expired_at is not None else "completed"
                await self._set(batch.id, status=ended, **({} if ended == "expired" else {"completed_at": now()}))

    async def _load(self, batch_id: str) -> Batch | None:
        async with self.db.session() as session:
            return await session.get(Batch, batch_id)

    async def _set(self, batch_id: str, **values) -> None:
        async with self.db.session() as session:
            await session.execute(update(Batch).where(Batch.id == batch_id).values(**values)
                                  .execution_options(synchronize_session=False))
            await session.commit()

    async def _validate(self, batch: Batch) -> None:
        endpoint = self.endpoints.get(batch.endpoint)
        async with self.db.session() as session:
            stored = await session.get(StoredFile, batch.input_file_id)
        try:
            if endpoint is None:
                raise InputError("invalid_endpoint", f"this server does not serve {batch.endpoint}")
            if stored is None:
                raise InputError("file_not_found", f"the input file {batch.input_file_id} was deleted")
            data = await asyncio.to_thread(self.blobs.read, stored.blob_key)
            lines = await asyncio.to_thread(parse, data, batch.endpoint, endpoint)
        except (InputError, BlobNotFound) as exc:
            code = exc.code if isinstance(exc, InputError) else "file_not_found"
            message = str(exc) if isinstance(exc, InputError) else f"the input file {batch.input_file_id} is gone"
            await self._set(batch.id, status="failed", failed_at=now(),
                            errors=[{"code": code, "message": message, "param": "input_file_id", "line": None}])
            return
        async with self.db.session() as session:
            # A gateway that took over half-way through validation starts it again.
            await session.execute(delete(BatchLine).where(BatchLine.batch_id == batch.id))
            for start in range(0, len(lines), LINE_ROWS_PER_COMMIT):
                session.add_all([BatchLine(batch_id=batch.id, line=ln.number, custom_id=ln.custom_id, body=ln.body,
                                           status="pending" if ln.body is not None else "failed", error=ln.message,
                                           result=None if ln.body is not None else
                                           results.never_ran(ln.custom_id, ln.number, ln.code, ln.message))
                                 for ln in lines[start:start + LINE_ROWS_PER_COMMIT]])
                await session.flush()
            failed = sum(1 for ln in lines if ln.body is None)
            await session.execute(update(Batch).where(Batch.id == batch.id, Batch.status == "validating")
                                  .values(status="in_progress", in_progress_at=now(), total=len(lines), failed=failed,
                                          completed=0).execution_options(synchronize_session=False))
            await session.commit()

    async def _execute(self, batch: Batch) -> None:
        """Run the pending lines until none is left, the batch is cancelled, or its window ends."""
        endpoint = self.endpoints[batch.endpoint]
        async with self.db.session() as session:
            user = await session.get(User, batch.user_id)
        if user is None:  # the account is gone (its batches go with it, where foreign keys are enforced)
            await self._set(batch.id, status="failed", failed_at=now(),
                            errors=[{"code": "user_not_found", "message": "the batch's account no longer exists"}])
            return
        queue: asyncio.Queue[BatchLine | None] = asyncio.Queue()
        async with self.db.session() as session:
            for row in await Batches(session).pending_lines(batch.id, limit=None):
                queue.put_nowait(row)
        # At most as many lines at once as the user's tier runs generations; they take none of the user's
        # own slots (batch requests count against the day's quota only), so their chat is never held up.
        width = min(self.settings.concurrency, max(1, self.user_slots(user)), max(1, queue.qsize()))
        ended = Ended(self.db, batch.id, self.quiet)
        workers = [asyncio.create_task(self._worker(endpoint, user, queue, ended)) for _ in range(width)]
        watch = asyncio.create_task(self._watch(batch))
        writer = asyncio.create_task(ended.run())
        try:
            done, _ = await asyncio.wait({watch, *workers}, return_when=asyncio.FIRST_COMPLETED)
            if watch in done:  # cancelled or expired: stop what runs
                for w in workers:
                    w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            for w in workers:
                if not w.cancelled() and w.exception() is not None:
                    raise w.exception()
        finally:
            for task in (watch, writer, *workers):
                task.cancel()
            await asyncio.gather(watch, writer, *workers, return_exceptions=True)
            await ended.flush()  # the lines that ended, before the batch moves on (or another gateway takes it)
        current = await self._load(batch.id)
        if current is not None and current.status == "in_progress":
            if current.expires_at is not None and now() >= _aware(current.expires_at):
                await self._expire(batch)
            else:
                await self._set(batch.id, status="finalizing", finalizing_at=now())

    async def _watch(self, batch: Batch) -> None:
        """Returns when the batch is cancelled (by any gateway) or its window ends."""
        while True:
            try:
                async with asyncio.timeout(self.settings.poll_s):
                    await self._poke.wait()
            except asyncio.TimeoutError:
                pass
            current = await self._load(batch.id)
            if current is None or current.status != "in_progress":
                return
            if current.expires_at is not None and now() >= _aware(current.expires_at):
                return

    async def _worker(self, endpoint: Endpoint, user: User, queue: asyncio.Queue, ended: Ended) -> None:
        while not queue.empty():
            # A line starts (its parsing, prompt, quota, admission: work on this event loop) only while no
            # interactive request is starting.
            await self.quiet()
            if queue.empty():
                return
            row = queue.get_nowait()
            result, ok = await self._answer(endpoint, user, row)
            ended.add(row.id, result, ok)

    async def _answer(self, endpoint: Endpoint, user: User, row: BatchLine) -> tuple[dict, bool]:
        """The line's output-file object, and whether it was answered with a 200."""
        while True:
            rid = results.request_id()
            try:
                return results.answered(row.custom_id, rid, 200, await endpoint.run(user, row.body, rid)), True
            except ApiError as exc:
                if cancel_requested():  # the line was stopped, and a library lost the CancelledError
                    raise asyncio.CancelledError from exc
                if exc.code == batch_class.GAVE_WAY:
                    continue  # the admission queue lets it in again once interactive traffic leaves room
                if exc.status in WAIT_AGAIN:
                    await asyncio.sleep(_retry_after(exc))
                    continue
                return results.refused(row.custom_id, rid, exc.status, exc.message, exc.code, exc.param), False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a backend failure: this line fails, the batch goes on
                log.warning("batch line %s failed: %r", row.line, exc)
                return results.refused(row.custom_id, rid, 500, f"generation failed: {exc}", "generation_failed",
                                       None), False

    async def _expire(self, batch: Batch) -> None:
        """The window ended: lines still pending go to the error file as batch_expired."""
        async with self.db.session() as session:
            rows = await Batches(session).pending_lines(batch.id, limit=None)
            for row in rows:
                row.status = "failed"
                row.result = results.never_ran(row.custom_id, row.line, "batch_expired",
                                               "this request could not be run before the batch expired")
            await session.execute(update(Batch).where(Batch.id == batch.id)
                                  .values(failed=Batch.failed + len(rows), status="finalizing", finalizing_at=now(),
                                          expired_at=now()).execution_options(synchronize_session=False))
            await session.commit()


async def _at_once() -> None:
    return None


def _retry_after(exc: ApiError) -> float:
    try:
        return min(60.0, max(0.1, float((exc.headers or {}).get("Retry-After", 1))))
    except ValueError:
        return 1.0


def _aware(when: datetime) -> datetime:
    """SQLite hands timestamps back without their zone; they were written in UTC."""
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)
