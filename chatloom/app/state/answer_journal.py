"""What a client is shown of an answer is in the database first.

A conversation answer's events reach its readers through a `JournaledLog`: answer text and reasoning
are first appended to the database (the `answer_chunks` table), and only once that write has
committed are they added to the event log that readers (SSE clients on this gateway, or on any
gateway through Redis) read. A process killed at any moment therefore leaves in the database at
least every piece of text any client received; recovery folds the rows into the message
(see recovery.py).

The write stays off the engine's path and costs one commit per step at most: `AnswerJournal` writes
everything pending from every answer of this process in one transaction (a group commit). While a
commit runs, new pieces queue, and the next transaction takes them all, so the database sees one
commit per engine step when it keeps up with the engine, and fewer, larger ones when it does not;
the engine and the generation task never wait for it. A piece reaches its readers one commit later
than it otherwise would, and the events of a log keep their order.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from chatloom.app.state.events import EventLog, StreamEvent
from chatloom.store import AnswerChunks, Database

log = logging.getLogger(__name__)

KINDS = {"token": "text", "thinking": "reasoning"}  # event field -> AnswerChunk.kind


class AnswerJournal:
    """Appends answer chunks for every answer of this process, in group commits."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._rows: list[dict] = []
        self._committed: asyncio.Future | None = None  # resolves when the pending rows are committed
        self._task: asyncio.Task | None = None
        self.commits = 0  # transactions written (for tests and measurements)

    async def write(self, rows: list[dict]) -> set[str]:
        """Append rows ({"message_id", "kind", "text", "tokens"}) and wait for their commit; returns the
        answers whose rows could not be written (their message was deleted meanwhile, or the database failed)."""
        if not rows:
            return set()
        self._rows.extend(rows)
        if self._committed is None:
            self._committed = asyncio.get_running_loop().create_future()
        committed = self._committed
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush(), name="answer-journal")
        failed = await asyncio.shield(committed)
        return {r["message_id"] for r in rows} & failed

    async def _flush(self) -> None:
        while self._rows:
            rows, committed = self._rows, self._committed
            self._rows, self._committed = [], None
            failed: set[str] = set()
            try:
                failed = await self._commit(rows)
            except BaseException:
                failed = {r["message_id"] for r in rows}
                raise
            finally:
                if committed is not None and not committed.done():
                    committed.set_result(failed)

    async def _commit(self, rows: list[dict]) -> set[str]:
        try:
            await self._insert(rows)
            return set()
        except Exception:  # one answer's rows can fail alone (its conversation was deleted): write the rest apart
            failed = set()
            for message_id in dict.fromkeys(r["message_id"] for r in rows):
                try:
                    await self._insert([r for r in rows if r["message_id"] == message_id])
                except Exception as exc:
                    log.warning("could not journal the text of answer %s: %s", message_id, exc)
                    failed.add(message_id)
            return failed

    async def _insert(self, rows: list[dict]) -> None:
        async with self.db.session() as session:
            await AnswerChunks(session).add(rows)
            await session.commit()
        self.commits += 1


class JournaledLog(EventLog):
    """An answer's event log whose text events are journaled before they are published.

    `append` never waits for the database: events queue, and one task per log journals each batch
    (text of consecutive events merged into one row) and then publishes its events, in order. An
    error from the log under it (another gateway took the answer over: LogTakenOver) is raised by
    the next `append`. If the journal cannot write, the text is published anyway (logged): an answer
    is not failed for its durability."""

    def __init__(self, inner: EventLog, journal: AnswerJournal, message_id: str, answer_tokens: int = 0) -> None:
        self.inner = inner
        self.key = inner.key
        self.journal = journal
        self.message_id = message_id
        self._tokens = answer_tokens  # the answer's token count at the last journaled text
        self._queue: list[tuple[dict, str | None, int | None, bool]] = []
        self._next = inner.next_id
        self._closed = False
        self._error: BaseException | None = None
        self._task: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def next_id(self) -> int:
        return self._next

    async def append(self, data: dict, event: str | None = None, answer_tokens: int | None = None,
                     saved: bool = False) -> int:
        """Queue an event; `saved`: its text is in the database already (a continued answer's start)."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError(f"event log {self.key} is closed")
        self._queue.append((data, event, answer_tokens, saved))
        self._idle.clear()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._publish(), name=f"journal-{self.message_id}")
        n = self._next
        self._next += 1
        return n

    async def _publish(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                rows = self._rows(batch)
                if rows and await self.journal.write(rows):
                    log.warning("answer %s: text published without being journaled", self.message_id)
                for data, event, answer_tokens, _ in batch:
                    await self.inner.append(data, event, answer_tokens)
        except Exception as exc:
            self._error = exc
            self._queue.clear()
        finally:
            if not self._queue:
                self._idle.set()

    def _rows(self, batch: list[tuple[dict, str | None, int | None, bool]]) -> list[dict]:
        rows: list[dict] = []
        for data, _, answer_tokens, saved in batch:
            n = 0
            if answer_tokens is not None:
                n, self._tokens = max(0, answer_tokens - self._tokens), answer_tokens
            field = next((f for f in KINDS if f in data), None)
            text = data.get(field) if field else None
            if saved or not text:
                continue
            kind = KINDS[field]
            if rows and rows[-1]["kind"] == kind:
                rows[-1]["text"] += text
                rows[-1]["tokens"] += n
            else:
                rows.append({"message_id": self.message_id, "kind": kind, "text": text, "tokens": n})
        return rows

    async def flush(self) -> None:
        """Wait until every queued event is journaled and published (or publishing failed)."""
        await self._idle.wait()

    async def close(self) -> None:
        if self._closed:
            return
        await self.flush()
        self._closed = True
        await self.inner.close()

    def discard(self) -> None:
        """Another gateway has the answer: publish nothing more from here."""
        self._closed = True
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()
        self._idle.set()

    async def settled(self) -> None:
        """Wait until the publishing task has ended: after discard(), nothing more is written from here."""
        if self._task is not None:
            await asyncio.wait({self._task})

    @property
    def closed(self) -> bool:
        return self._closed

    def read(self, after: int = 0, heartbeat_s: float | None = None) -> AsyncIterator[StreamEvent | None]:
        return self.inner.read(after, heartbeat_s)
