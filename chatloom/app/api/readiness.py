"""What /readyz checks: the model backend, the database and the hot-state store (Redis).

A gateway is ready when all three answer. A database or Redis that is out of reach makes it 503
with a message naming which and why; nothing needs restarting: every check connects afresh, so the
gateway is ready again as soon as the server is back.
"""
from __future__ import annotations

import asyncio

from sqlalchemy import text

from chatloom.serving import Backend
from chatloom.store import Database

CHECK_TIMEOUT_S = 2.0


async def check_database(db: Database) -> dict:
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            async with db.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
    except Exception as exc:
        where = db.engine.url.render_as_string(hide_password=True)
        return {"status": "unavailable",
                "error": f"the database ({where}) is unreachable ({type(exc).__name__}: {exc}); retry shortly"}
    return {"status": "ok", "dialect": db.engine.dialect.name}


def check_backend(backend: Backend) -> dict:
    if backend.ready:
        return {"status": "ok", "models": backend.model_ids}
    if backend.load_error:
        return {"status": "failed", "error": backend.load_error}
    return {"status": "loading"}


async def readiness(backend: Backend, db: Database, hot) -> tuple[int, dict]:
    """(HTTP status, body) for /readyz."""
    checks = {"backend": check_backend(backend), "database": await check_database(db),
              "redis": await hot.check() if hot is not None else {"status": "not configured"}}
    problems = [c["error"] for c in (checks["database"], checks["redis"]) if c["status"] == "unavailable"]
    if backend.ready and not problems:
        return 200, {"status": "ready", "models": backend.model_ids, "context_window": backend.context_window,
                     "checks": checks}
    if problems:
        return 503, {"status": "unavailable", "error": "; ".join(problems), "checks": checks}
    return 503, {"status": "failed", "error": backend.load_error} if backend.load_error else {"status": "loading"}
