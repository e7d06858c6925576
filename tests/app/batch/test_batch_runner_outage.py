"""The batch runner's loop through a database outage: one warning line per try, not a traceback."""
from __future__ import annotations

import asyncio
import logging

from sqlalchemy.exc import OperationalError

from chatloom.app.batch.runner import BatchRunner
from chatloom.settings import Settings


async def test_a_database_outage_is_a_warning_and_the_loop_goes_on(caplog):
    settings = Settings(batch={"poll_s": 0.01})
    runner = BatchRunner(None, None, settings, {}, "instance", alive=lambda ids: asyncio.sleep(0, ids))
    tries = []
    looked_again = asyncio.Event()

    async def tick() -> None:
        tries.append(1)
        if len(tries) < 3:
            raise OperationalError("SELECT 1", {}, ConnectionRefusedError(111, "Connect call failed"))
        looked_again.set()

    runner.tick = tick
    with caplog.at_level(logging.WARNING, logger="chatloom.app.batch.runner"):
        await runner.start()
        await asyncio.wait_for(looked_again.wait(), 10)
        await runner.close()
    records = [r for r in caplog.records if r.name == "chatloom.app.batch.runner"]
    assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING]
    assert all(r.exc_info is None and "OperationalError" in r.getMessage() for r in records)
