"""Vector search in the database, where it has an extension for it: pgvector on PostgreSQL, sqlite-vec on SQLite.

Passages keep their vectors as little-endian float32 bytes (`file_chunks.embedding`) everywhere. Where
PostgreSQL offers pgvector, `ensure_pgvector` (at every start, after the migrations, so an extension
installed later is taken up) creates the extension, adds `file_chunks.embedding_vec` (pgvector's `vector`, any
width) and fills it from the bytes; the app writes it beside the bytes from then on. SQLite loads the
sqlite-vec package's extension into each connection when its `sqlite3` module can load extensions
(Python built with them); sqlite-vec reads the float32 bytes as they are. Either way the search stays
exact, over the asking user's passages in scope only (no approximate index: its results would differ
from the exact search's), and only the ordering moves into the database: no vectors travel to Python.
Without either, files/search.py ranks the vectors in numpy.
"""
from __future__ import annotations

import logging

import numpy as np
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

log = logging.getLogger(__name__)

PG_COLUMN = "embedding_vec"
PGVECTOR = "pgvector"
SQLITE_VEC = "sqlite-vec"
_BACKFILL_BATCH = 500


def pg_literal(vector: bytes | list[float]) -> str:
    """A vector in pgvector's text form, from stored float32 bytes or a list."""
    values = np.frombuffer(vector, dtype="<f4") if isinstance(vector, bytes) else np.asarray(vector, np.float32)
    return "[" + ",".join(repr(float(x)) for x in values) + "]"


def has_pgvector_column(conn: Connection) -> bool:
    return conn.execute(text(
        "SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
        f"AND table_name = 'file_chunks' AND column_name = '{PG_COLUMN}'")).first() is not None


def ensure_pgvector(conn: Connection) -> bool:
    """On PostgreSQL with pgvector installed: the extension, the column and its values for passages
    stored before; whether vector search can use it. Quiet where the extension is missing or this role
    may not create it (the exact search stays)."""
    if conn.dialect.name != "postgresql":
        return False
    if conn.execute(text("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")).first() is None:
        return False
    # In a savepoint: a role that may not create extensions (or a gateway beside this one creating it at
    # the same moment) leaves the transaction usable.
    try:
        with conn.begin_nested():
            conn.execute(text("CREATE EXTENSION IF NOT EXISTS vector"))
    except DBAPIError as exc:
        log.info("pgvector not created: %s", exc.orig)
    if conn.execute(text("SELECT 1 FROM pg_extension WHERE extname = 'vector'")).first() is None:
        log.info("pgvector is installed but this role may not create it: exact vector search in Python")
        return False
    if not has_pgvector_column(conn):
        conn.execute(text(f"ALTER TABLE file_chunks ADD COLUMN IF NOT EXISTS {PG_COLUMN} vector"))
    while True:
        rows = conn.execute(text(f"SELECT id, embedding FROM file_chunks WHERE embedding IS NOT NULL AND "
                                 f"{PG_COLUMN} IS NULL LIMIT {_BACKFILL_BATCH}")).all()
        if not rows:
            return True
        conn.execute(text(f"UPDATE file_chunks SET {PG_COLUMN} = CAST(:v AS vector) WHERE id = :id"),
                     [{"id": i, "v": pg_literal(e)} for i, e in rows])


def load_sqlite_vec(dbapi_connection) -> bool:
    """Load sqlite-vec into a new SQLite connection (SQLAlchemy's aiosqlite adapter); False where the
    package is missing or Python's sqlite3 was built without extension loading."""
    try:
        import sqlite_vec
    except ImportError:
        return False
    path = sqlite_vec.loadable_path()

    async def load(conn) -> None:
        await conn.enable_load_extension(True)
        try:
            await conn.load_extension(path)
        finally:
            await conn.enable_load_extension(False)
    try:
        dbapi_connection.run_async(load)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the exact search
        log.debug("sqlite-vec not loaded: %s", exc)
        return False
    return True


async def write_pg_vectors(session, rows: list[tuple[int, bytes]]) -> None:
    """Set the pgvector column of passages just written (id, float32 bytes); call only with pgvector."""
    if rows:
        await session.execute(text(f"UPDATE file_chunks SET {PG_COLUMN} = CAST(:v AS vector) WHERE id = :id"),
                              [{"id": i, "v": pg_literal(e)} for i, e in rows])
