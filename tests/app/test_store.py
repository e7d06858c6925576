"""The store: migrations match the models on SQLite and on a real PostgreSQL server (the db_url fixture
runs each test on both), render for PostgreSQL offline, and SQLite runs in WAL mode."""
from __future__ import annotations

import io

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from chatloom.store import Base, Conversations, Database, Messages, Users
from chatloom.store.file_chunks import is_search_index
from chatloom.store.database import alembic_config, normalize_url


async def test_migrations_create_exactly_the_models_tables(db_url):
    db = Database(db_url)
    await db.migrate()
    await db.migrate()  # idempotent

    def diff(sync_conn):
        context = MigrationContext.configure(sync_conn, opts={
            "include_name": lambda name, type_, parents: not is_search_index(name)})
        return compare_metadata(context, Base.metadata)

    async with db.engine.connect() as conn:
        assert await conn.run_sync(diff) == []
        if db.is_sqlite:
            assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar() == "wal"
            assert (await conn.exec_driver_sql("PRAGMA foreign_keys")).scalar() == 1
        else:
            assert db.engine.dialect.name == "postgresql"
            assert (await conn.exec_driver_sql("SELECT version_num FROM alembic_version")).scalar()
    await db.close()


async def test_sqlite_folders_are_created(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/sub/dir/test.db")  # missing folders are created
    await db.migrate()
    assert (tmp_path / "sub" / "dir" / "test.db").is_file()
    await db.close()


def test_migrations_render_for_postgresql():
    """Offline mode emits the DDL without a server: proof the migration uses no SQLite-only SQL."""
    out = io.StringIO()
    cfg = alembic_config(url="postgresql://user@localhost/chatloom")
    cfg.output_buffer = out
    command.upgrade(cfg, "head", sql=True)
    sql = out.getvalue()
    assert "CREATE TABLE messages" in sql and "TIMESTAMP WITH TIME ZONE" in sql
    assert "DEFAULT false" in sql and "AUTOINCREMENT" not in sql


def test_url_normalization():
    assert normalize_url("sqlite:///./data/x.db") == "sqlite+aiosqlite:///./data/x.db"
    assert normalize_url("postgresql://u:p@h/db") == "postgresql+asyncpg://u:p@h/db"
    assert normalize_url("postgresql+asyncpg://u:p@h/db") == "postgresql+asyncpg://u:p@h/db"


async def test_repositories_round_trip(db_url):
    db = Database(db_url)
    await db.migrate()
    async with db.session() as s:
        user = await Users(s).create("u", None)
        conv = await Conversations(s).create(user.id, "t")
        q = await Messages(s).add(conv.id, None, "user", "hi", 2)
        a = await Messages(s).add(conv.id, q.id, "assistant", "", 0, "m", status="incomplete")
        await s.commit()
    async with db.session() as s:
        assert await Messages(s).finish(a.id, text="hello", tokens=5, status="complete", finish_reason="stop")
        await s.commit()
        rows = await Messages(s).all_in(conv.id)
        assert [(m.role, m.text, m.status) for m in rows] == [("user", "hi", "complete"),
                                                              ("assistant", "hello", "complete")]
        assert (await Users(s).get(user.id)).tier == "free"
        assert await Conversations(s).get_owned("someone-else", conv.id) is None
        await Conversations(s).delete(conv.id)
        await s.commit()
        assert await Messages(s).all_in(conv.id) == []
        assert not await Messages(s).finish(a.id, text="late")
    await db.close()


async def test_usage_totals_per_tier_for_one_day(db_url):
    from chatloom.store import UsageRows

    db = Database(db_url)
    await db.migrate()
    async with db.session() as s:
        users = Users(s)
        a, b, c = [await users.create(n, None) for n in ("a", "b", "c")]
        await users.set_tier("c", "pro")
        rows = UsageRows(s)
        await rows.add(a.id, "2026-01-02", "m1", 10, 5, 4)
        await rows.add(a.id, "2026-01-02", "m2", 1, 1, 0)
        await rows.add(b.id, "2026-01-02", "m1", 20, 10, 0, requests=3)
        await rows.add(c.id, "2026-01-02", "m1", 7, 3, 2)
        await rows.add(c.id, "2026-01-01", "m1", 100, 100, 100)  # another day
        await s.commit()
    async with db.session() as s:
        assert await UsageRows(s).by_tier("2026-01-02") == [("free", 2, 5, 31, 16, 4), ("pro", 1, 1, 7, 3, 2)]
        assert await UsageRows(s).by_tier("2026-01-03") == []
    await db.close()
