"""The lines of a running batch that have ended, written to the database a few at a time.

A line's result waits here until the next write: one transaction for all the lines that ended in the last
`WRITE_EVERY_S` (and the batch's counts with them) instead of a session and a commit per line, and no
write while an interactive request is starting (`quiet`), so this work on the gateway's event loop stays
out of that request's time to first token. A gateway that dies loses the results not yet written: those
lines are still pending in the database, and the gateway that takes the batch over runs them again.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from sqlalchemy import update

from chatloom.store import Database
from chatloom.store.batches import Batch, BatchLine

log = logging.getLogger(__name__)

WRITE_EVERY_S = 0.5


class Ended:
    def __init__(self, db: Database, batch_id: str, quiet: Callable[[], Awaitable[None]]) -> None:
        self.db = db
        self.batch_id = batch_id
        self.quiet = quiet
        self._results: list[tuple[int, dict, bool]] = []  # line id, output-file object, answered with a 200
        self._added = asyncio.Event()

    def add(self, line_id: int, result: dict, ok: bool) -> None:
        self._results.append((line_id, result, ok))
        self._added.set()

    async def run(self) -> None:
        """Write what has ended, every WRITE_EVERY_S while lines end (until cancelled)."""
        while True:
            await self._added.wait()
            await asyncio.sleep(WRITE_EVERY_S)
            await self.quiet()
            self._added.clear()
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:  # the database away: kept for the next write
                log.exception("writing the results of batch %s", self.batch_id)
                self._added.set()

    async def flush(self) -> None:
        """Write every result held now, in one transaction; on failure they stay held."""
        results, self._results = self._results, []
        if not results:
            return
        try:
            counts = {True: 0, False: 0}
            async with self.db.session() as session:
                for line_id, result, ok in results:
                    # Only a pending line: one another gateway finished or expired meanwhile keeps its result.
                    changed = await session.execute(
                        update(BatchLine).where(BatchLine.id == line_id, BatchLine.status == "pending")
                        .values(status="done" if ok else "failed", result=result)
                        .execution_options(synchronize_session=False))
                    counts[ok] += changed.rowcount
                if counts[True] or counts[False]:
                    await session.execute(update(Batch).where(Batch.id == self.batch_id)
                                          .values(completed=Batch.completed + counts[True],
                                                  failed=Batch.failed + counts[False])
                                          .execution_options(synchronize_session=False))
                await session.commit()
        except BaseException:
            self._results = results + self._results
            raise
