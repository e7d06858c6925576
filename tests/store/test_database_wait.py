"""A gateway started while its database restarts waits for it (store/database.py: migrate(wait_s)):
what counts as "not reachable yet", the retries, and the errors that are raised at once."""
from __future__ import annotations

import socket
import time

import pytest
from sqlalchemy.exc import DBAPIError

from chatloom.store import Database
from chatloom.store.database import unreachable


class DriverError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"sqlstate {sqlstate}")
        self.sqlstate = sqlstate


def _dbapi(sqlstate: str) -> DBAPIError:
    return DBAPIError("select 1", {}, DriverError(sqlstate))


def test_what_counts_as_a_database_not_reachable_yet():
    assert unreachable(ConnectionRefusedError())
    assert unreachable(_dbapi("57P01"))  # terminating connection due to administrator command
    assert unreachable(_dbapi("57P03"))  # the database system is starting up
    assert unreachable(_dbapi("08006"))  # connection failure
    wrapped = DBAPIError("select 1", {}, Exception("adapter"))
    wrapped.orig.__cause__ = DriverError("57P01")  # the driver's error under the DB-API adapter's
    assert unreachable(wrapped)
    assert not unreachable(_dbapi("42P01"))  # undefined table: a real error, not an outage
    assert not unreachable(_dbapi("28P01"))  # wrong password: waiting will not help
    assert not unreachable(ValueError("bad"))


async def test_migrate_retries_while_unreachable_then_succeeds(tmp_path):
    db = Database(f"sqlite+aiosqlite:///{tmp_path}/c.db")
    calls = []
    real = db._migrate

    async def flaky() -> None:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise _dbapi("57P03")
        await real()

    db._migrate = flaky
    try:
        await db.migrate(wait_s=10.0)
        assert len(calls) == 3 and calls[2] - calls[0] >= 0.5  # 0.25 s, then 0.5 s apart
    finally:
        await db.close()


async def test_a_real_error_or_no_wait_is_raised_at_once(tmp_path):
    db = Database(f"sqlite+aiosqlite:///{tmp_path}/c.db")
    calls = []

    async def broken() -> None:
        calls.append(1)
        raise _dbapi("42P01")

    db._migrate = broken
    with pytest.raises(DBAPIError):
        await db.migrate(wait_s=10.0)
    assert len(calls) == 1
    await db.close()


async def test_a_database_that_never_comes_fails_after_the_wait():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = Database(f"postgresql+asyncpg://chatloom@127.0.0.1:{port}/chatloom")
    t0 = time.monotonic()
    with pytest.raises(OSError):
        await db.migrate(wait_s=0.0)  # no wait: the first refusal is the answer
    assert time.monotonic() - t0 < 5
    t0 = time.monotonic()
    with pytest.raises(OSError):
        await db.migrate(wait_s=1.0)
    assert 0.5 <= time.monotonic() - t0 < 6  # retried until the wait was spent, then gave up
    await db.close()
