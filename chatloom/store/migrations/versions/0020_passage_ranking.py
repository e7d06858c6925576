"""ranking passages on PostgreSQL as FTS5 does: stop words kept for phrases, text split at non-alphanumerics

The passages' stored tsvector is remade in a configuration of its own, `chatloom_english` (English stems
without the stop-word list: the ranking leaves function words out of single terms itself but needs them
for phrases such as "not exist"), over the text with every run of other characters made a space, as
SQLite's unicode61 tokenizer splits it ("/readyz" and "max_tokens" hold the words of a question that
says "readyz" or "max tokens").

(pgvector's column, where the server offers the extension, is added at start, not here: an extension
installed later is taken up at the next start; store/vector_index.py. Going down drops it.)

Revision ID: 0020
Revises: 0019
"""
from __future__ import annotations

from alembic import op

from chatloom.store.vector_index import PG_COLUMN

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_CONFIG = [
    "CREATE TEXT SEARCH DICTIONARY chatloom_english_stem (TEMPLATE = snowball, Language = english)",
    "CREATE TEXT SEARCH CONFIGURATION chatloom_english (COPY = english)",
    "ALTER TEXT SEARCH CONFIGURATION chatloom_english ALTER MAPPING REPLACE english_stem WITH chatloom_english_stem",
]


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    for statement in _CONFIG:
        op.execute(statement)
    op.execute("ALTER TABLE file_chunks DROP COLUMN text_fts")  # its GIN index goes with it
    op.execute("ALTER TABLE file_chunks ADD COLUMN text_fts tsvector GENERATED ALWAYS AS (to_tsvector("
               "'chatloom_english', regexp_replace(text, '[^[:alnum:]]+', ' ', 'g'))) STORED")
    op.execute("CREATE INDEX ix_file_chunks_text_fts ON file_chunks USING gin (text_fts)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    op.execute(f"ALTER TABLE file_chunks DROP COLUMN IF EXISTS {PG_COLUMN}")  # the extension stays
    op.execute("ALTER TABLE file_chunks DROP COLUMN text_fts")
    op.execute("ALTER TABLE file_chunks ADD COLUMN text_fts tsvector "
               "GENERATED ALWAYS AS (to_tsvector('english', text)) STORED")
    op.execute("CREATE INDEX ix_file_chunks_text_fts ON file_chunks USING gin (text_fts)")
    op.execute("DROP TEXT SEARCH CONFIGURATION chatloom_english")
    op.execute("DROP TEXT SEARCH DICTIONARY chatloom_english_stem")
