"""retrieval over files: passages, collections, attachments, citations; full-text indexes

Revision ID: 0011
Revises: 0010
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_SQLITE_FTS = [
    # Passages: an external-content index over file_chunks (integer keys), kept in step by triggers.
    "CREATE VIRTUAL TABLE file_chunks_fts USING fts5(text, content='file_chunks', content_rowid='id', "
    "tokenize='porter unicode61')",
    "CREATE TRIGGER file_chunks_fts_ai AFTER INSERT ON file_chunks BEGIN "
    "INSERT INTO file_chunks_fts(rowid, text) VALUES (new.id, new.text); END",
    "CREATE TRIGGER file_chunks_fts_ad AFTER DELETE ON file_chunks BEGIN "
    "INSERT INTO file_chunks_fts(file_chunks_fts, rowid, text) VALUES ('delete', old.id, old.text); END",
    "CREATE TRIGGER file_chunks_fts_au AFTER UPDATE OF text ON file_chunks BEGIN "
    "INSERT INTO file_chunks_fts(file_chunks_fts, rowid, text) VALUES ('delete', old.id, old.text); "
    "INSERT INTO file_chunks_fts(rowid, text) VALUES (new.id, new.text); END",
    # Conversations: titles and messages in one index that keeps its own copy of the text, keyed by the
    # rows' string ids (their implicit rowids may change in a VACUUM).
    "CREATE VIRTUAL TABLE chat_fts USING fts5(text, kind UNINDEXED, message_id UNINDEXED, "
    "conversation_id UNINDEXED, user_id UNINDEXED, tokenize='porter unicode61')",
    "CREATE TRIGGER chat_fts_message_ai AFTER INSERT ON messages WHEN new.text != '' BEGIN "
    "INSERT INTO chat_fts(text, kind, message_id, conversation_id, user_id) SELECT new.text, 'message', new.id, "
    "new.conversation_id, c.user_id FROM conversations c WHERE c.id = new.conversation_id; END",
    "CREATE TRIGGER chat_fts_message_au AFTER UPDATE OF text ON messages WHEN new.text IS NOT old.text BEGIN "
    "DELETE FROM chat_fts WHERE message_id = old.id; "
    "INSERT INTO chat_fts(text, kind, message_id, conversation_id, user_id) SELECT new.text, 'message', new.id, "
    "new.conversation_id, c.user_id FROM conversations c WHERE c.id = new.conversation_id AND new.text != ''; END",
    "CREATE TRIGGER chat_fts_title_ai AFTER INSERT ON conversations WHEN new.title IS NOT NULL BEGIN "
    "INSERT INTO chat_fts(text, kind, conversation_id, user_id) VALUES (new.title, 'title', new.id, new.user_id); END",
    "CREATE TRIGGER chat_fts_title_au AFTER UPDATE OF title ON conversations WHEN new.title IS NOT old.title BEGIN "
    "DELETE FROM chat_fts WHERE conversation_id = old.id AND kind = 'title'; "
    "INSERT INTO chat_fts(text, kind, conversation_id, user_id) SELECT new.title, 'title', new.id, new.user_id "
    "WHERE new.title IS NOT NULL; END",
    "CREATE TRIGGER chat_fts_conversation_ad AFTER DELETE ON conversations BEGIN "
    "DELETE FROM chat_fts WHERE conversation_id = old.id; END",
    # What was written before this revision.
    "INSERT INTO chat_fts(text, kind, conversation_id, user_id) SELECT title, 'title', id, user_id "
    "FROM conversations WHERE title IS NOT NULL",
    "INSERT INTO chat_fts(text, kind, message_id, conversation_id, user_id) SELECT m.text, 'message', m.id, "
    "m.conversation_id, c.user_id FROM messages m JOIN conversations c ON c.id = m.conversation_id WHERE m.text != ''",
]

_POSTGRES_FTS = [
    "CREATE INDEX ix_file_chunks_fts ON file_chunks USING gin (to_tsvector('english', text))",
    "CREATE INDEX ix_messages_fts ON messages USING gin (to_tsvector('english', text))",
    "CREATE INDEX ix_conversations_fts ON conversations USING gin (to_tsvector('english', coalesce(title, '')))",
]


def upgrade() -> None:
    op.create_table(
        "file_chunks",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("file_id", sa.String(length=40), nullable=False),
        sa.Column("user_id", sa.String(length=40), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("char_start", sa.Integer(), nullable=False),
        sa.Column("char_end", sa.Integer(), nullable=False),
        sa.Column("page", sa.Integer(), nullable=True),
        sa.Column("embedding", sa.LargeBinary(), nullable=True),
        sa.Column("embedding_model", sa.String(length=200), nullable=True),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], name=op.f("fk_file_chunks_file_id_files"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name=op.f("fk_file_chunks_user_id_users"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_file_chunks")),
    )
    op.create_index("ix_file_chunks_file_ordinal", "file_chunks", ["file_id", "ordinal"], unique=False)
    op.create_index(op.f("ix_file_chunks_user_id"), "file_chunks", ["user_id"], unique=False)
    op.create_table(
        "file_texts",
        sa.Column("file_id", sa.String(length=40), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], name=op.f("fk_file_texts_file_id_files"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("file_id", name=op.f("pk_file_texts")),
    )
    op.create_table(
        "collections",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("user_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("created", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name=op.f("fk_collections_user_id_users"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_collections")),
        sa.UniqueConstraint("user_id", "name", name="uq_collections_user_name"),
    )
    op.create_table(
        "collection_files",
        sa.Column("collection_id", sa.String(length=40), nullable=False),
        sa.Column("file_id", sa.String(length=40), nullable=False),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"],
                                name=op.f("fk_collection_files_collection_id_collections"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], name=op.f("fk_collection_files_file_id_files"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("collection_id", "file_id", name=op.f("pk_collection_files")),
    )
    op.create_index(op.f("ix_collection_files_file_id"), "collection_files", ["file_id"], unique=False)
    op.create_table(
        "conversation_files",
        sa.Column("conversation_id", sa.String(length=40), nullable=False),
        sa.Column("file_id", sa.String(length=40), nullable=False),
        sa.ForeignKeyConstraint(["conversation_id"], ["conversations.id"],
                                name=op.f("fk_conversation_files_conversation_id_conversations"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], name=op.f("fk_conversation_files_file_id_files"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("conversation_id", "file_id", name=op.f("pk_conversation_files")),
    )
    op.create_index(op.f("ix_conversation_files_file_id"), "conversation_files", ["file_id"], unique=False)
    op.create_table(
        "conversation_collections",
        sa.Column("conversation_id", sa.String(length=40), nullable=False),
        sa.Column("collection_id", sa.String(length=40), nullable=False),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"],
                                name=op.f("fk_conversation_collections_collection_id_collections"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["conversation_id"], ["conversations.id"],
                                name=op.f("fk_conversation_collections_conversation_id_conversations"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("conversation_id", "collection_id", name=op.f("pk_conversation_collections")),
    )
    op.create_index(op.f("ix_conversation_collections_collection_id"), "conversation_collections",
                    ["collection_id"], unique=False)
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("citations", sa.JSON(), nullable=True))
    statements = _SQLITE_FTS if op.get_bind().dialect.name == "sqlite" else _POSTGRES_FTS
    for statement in statements:
        op.execute(statement)


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        for trigger in ("file_chunks_fts_ai", "file_chunks_fts_ad", "file_chunks_fts_au", "chat_fts_message_ai",
                        "chat_fts_message_au", "chat_fts_title_ai", "chat_fts_title_au", "chat_fts_conversation_ad"):
            op.execute(f"DROP TRIGGER IF EXISTS {trigger}")
        op.execute("DROP TABLE IF EXISTS chat_fts")
        op.execute("DROP TABLE IF EXISTS file_chunks_fts")
    else:
        for index in ("ix_file_chunks_fts", "ix_messages_fts", "ix_conversations_fts"):
            op.execute(f"DROP INDEX IF EXISTS {index}")
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("citations")
    op.drop_table("conversation_collections")
    op.drop_table("conversation_files")
    op.drop_table("collection_files")
    op.drop_table("collections")
    op.drop_table("file_texts")
    op.drop_index("ix_file_chunks_file_ordinal", table_name="file_chunks")
    op.drop_table("file_chunks")
