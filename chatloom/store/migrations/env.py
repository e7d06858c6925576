"""Alembic environment, driven from code (chatloom.store.database.migrate) rather than alembic.ini.

migrate() hands over a live synchronous connection in config.attributes["connection"].
For the `alembic` command line (writing new revisions), set sqlalchemy.url instead.
"""
from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from chatloom.store.file_chunks import is_search_index
from chatloom.store.models import Base

config = context.config
target_metadata = Base.metadata


def include_name(name, type_, parent_names) -> bool:
    """The full-text index (FTS5 tables, expression indexes) is made by hand in its migration."""
    return not is_search_index(name)


def _run(connection) -> None:
    # Batch mode lets later migrations alter columns on SQLite too.
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=connection.dialect.name == "sqlite", include_name=include_name)
    with context.begin_transaction():
        context.run_migrations()


async def _run_from_url(url: str) -> None:
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.run_sync(_run)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif config.attributes.get("connection") is not None:
    _run(config.attributes["connection"])
else:
    asyncio.run(_run_from_url(config.get_main_option("sqlalchemy.url")))
