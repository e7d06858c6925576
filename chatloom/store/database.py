"""The database handle: engine, sessions, SQLite tuning and migrations at start."""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from chatloom.store.vector_index import PGVECTOR, SQLITE_VEC, ensure_pgvector, load_sqlite_vec

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"
DEFAULT_URL = "sqlite+aiosqlite:///./data/chatloom.db"


def normalize_url(url: str) -> str:
    """Pick the async driver for plain URLs (sqlite://, postgresql://)."""
    u = make_url(url)
    if u.drivername == "sqlite":
        u = u.set(drivername="sqlite+aiosqlite")
    elif u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+asyncpg")
    return u.render_as_string(hide_password=False)


def _sqlite_file(url: str) -> Path | None:
    u = make_url(url)
    if not u.drivername.startswith("sqlite") or not u.database or u.database == ":memory:":
        return None
    return Path(u.database)


def _tune_sqlite(dbapi_connection, _record) -> None:
    # WAL lets readers run while one writer writes; busy_timeout makes writers queue instead of failing.
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def alembic_config(connection=None, url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if url:
        cfg.set_main_option("sqlalchemy.url", url)
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


class Database:
    def __init__(self, url: str = DEFAULT_URL, echo: bool = False) -> None:
        self.url = normalize_url(url)
        path = _sqlite_file(self.url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.engine: AsyncEngine = create_async_engine(self.url, echo=echo)
        # How vector search runs here (vector_index.py): "pgvector", "sqlite-vec", or None (exact, in numpy).
        self.vector_search: str | None = None
        self._sqlite_vec_loaded = False
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _tune_sqlite)
            event.listen(self.engine.sync_engine, "connect", self._load_sqlite_vec)
        # expire_on_commit=False: rows stay readable after commit, outside the session's transaction.
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    def session(self) -> AsyncSession:
        return self.sessions()

    async def migrate(self, wait_s: float = 0.0) -> None:
        """Bring the schema to the newest revision; for up to `wait_s`, retry while the database cannot be
        reached (refused, restarting, shutting down), so a gateway started beside a restarting PostgreSQL
        waits for it instead of exiting. Any other error, and the last one after `wait_s`, is raised."""
        deadline = time.monotonic() + wait_s
        pause = 0.25
        while True:
            try:
                return await self._migrate()
            except Exception as exc:
                if not unreachable(exc) or time.monotonic() + pause > deadline:
                    raise
                log.warning("database not reachable yet (%s); retrying for up to %.0f s more",
                            first_line(exc), deadline - time.monotonic())
                await self.engine.dispose()  # no pooled connection from before the outage is reused
                await asyncio.sleep(pause)
                pause = min(2.0, pause * 2)

    async def _migrate(self) -> None:
        def upgrade(sync_conn) -> None:
            command.upgrade(alembic_config(sync_conn), "head")

        async with self.engine.begin() as conn:
            await conn.run_sync(upgrade)
        async with self.engine.begin() as conn:
            if self.is_sqlite:
                await conn.execute(text("SELECT 1"))  # a connection has been made: sqlite-vec loaded or not
                self.vector_search = SQLITE_VEC if self._sqlite_vec_loaded else None
            else:
                self.vector_search = PGVECTOR if await conn.run_sync(ensure_pgvector) else None
        log.info("vector search: %s", self.vector_search or "exact, in the gateway")
        log.info("database schema up to date (%s)", self.engine.url.render_as_string(hide_password=True))

    def _load_sqlite_vec(self, dbapi_connection, _record) -> None:
        self._sqlite_vec_loaded = load_sqlite_vec(dbapi_connection) or self._sqlite_vec_loaded

    async def close(self) -> None:
        await self.engine.dispose()


# SQLSTATE classes of a database that is there but not serving now: 08 connection exception, 57P operator
# intervention (shutting down, starting up, terminated by an administrator).
_TRANSIENT_SQLSTATES = ("08", "57P")


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the database cannot be reached now, rather than that the request was wrong."""
    if isinstance(exc, (OSError, asyncio.TimeoutError)):
        return True
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    cause: BaseException | None = exc.orig
    while cause is not None:  # the driver's own exception may sit under the DB-API adapter's
        state = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
        if isinstance(state, str) and state.startswith(_TRANSIENT_SQLSTATES):
            return True
        if isinstance(cause, OSError):
            return True
        cause = cause.__cause__
    return False


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]
