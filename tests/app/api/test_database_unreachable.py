"""The database restarting under a request: a 503 database_unavailable with Retry-After (it comes back),
not a 500. asyncpg's refused connect reaches the app as a bare ConnectionRefusedError; a connection lost
mid-query as SQLAlchemy's OperationalError or a DBAPIError with connection_invalidated."""
from __future__ import annotations

import pytest
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from chatloom.store import files as files_module


class _Shutdown(Exception):
    pass


_Shutdown.__name__ = "AdminShutdownError"


@pytest.mark.parametrize("error", [
    ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)"),
    OperationalError("INSERT", {}, Exception("server closed the connection unexpectedly")),
    DBAPIError("INSERT", {}, _Shutdown("terminating connection due to administrator command")),
], ids=["refused", "operational", "admin shutdown"])
async def test_a_database_away_is_a_503_with_retry_after(client, alice, monkeypatch, error):
    async def unreachable(*args, **kwargs):
        raise error

    monkeypatch.setattr(files_module.StoredFiles, "save", unreachable)
    r = await client.post("/v1/files", headers=alice, files={"file": ("a.txt", b"hi")}, data={"purpose": "user_data"})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "database_unavailable" and r.headers["Retry-After"] == "2"


async def test_a_database_error_of_the_request_stays_a_500(client, alice, monkeypatch):
    async def broken(*args, **kwargs):
        raise IntegrityError("INSERT", {}, Exception("duplicate key"))

    monkeypatch.setattr(files_module.StoredFiles, "save", broken)
    r = await client.post("/v1/files", headers=alice, files={"file": ("a.txt", b"hi")}, data={"purpose": "user_data"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
