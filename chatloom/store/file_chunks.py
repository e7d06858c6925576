"""What retrieval over uploaded files stores: passages of each file, collections, and what is attached where.

A file's text is cut into overlapping passages (`FileChunk`), each with its place in the text and, where
embeddings are on, its vector (float32 bytes). Full-text search runs on the database's own index over
the passages and over conversations: SQLite FTS5 tables kept in step by triggers (migration 0011), and on
PostgreSQL a stored tsvector column of passages, `text_fts` (0014, 0020), and GIN indexes on `to_tsvector` of
messages and titles (0011); `is_search_index` names them, so schema comparisons leave them be. Files attach to a conversation, or to a named collection that attaches to many.
"""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, DateTime, ForeignKey, Index, Integer, LargeBinary, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from chatloom.store.models import Base, new_id, utcnow
from chatloom.store.vector_index import PG_COLUMN

# PostgreSQL's text search configuration for conversation search (stemmed English, stop words dropped).
TS_CONFIG = "english"
# ... and for ranking passages and older turns (migration 0020): English stems with the stop words kept,
# so a phrase such as "not exist" can match as FTS5's does; single terms leave them out (files/search.py).
RANK_TS_CONFIG = "chatloom_english"


def rank_tsvector(column: str) -> str:
    """SQL of the tsvector passages and turns are ranked by: the text's runs of letters and digits (every
    other character a separator, as FTS5's tokenizer has it, so "/readyz" holds the word "readyz") in
    `RANK_TS_CONFIG`."""
    return f"to_tsvector('{RANK_TS_CONFIG}', regexp_replace({column}, '[^[:alnum:]]+', ' ', 'g'))"


def is_search_index(name: str | None) -> bool:
    """Whether a table, column or index is part of the full-text or vector index (FTS5 tables and their
    shadow tables, PostgreSQL's tsvector column and GIN indexes, pgvector's column), made by the migrations
    and not described by the models."""
    return bool(name) and ("_fts" in name or name == PG_COLUMN)


class FileChunk(Base):
    """One passage of a file's extracted text."""

    __tablename__ = "file_chunks"
    __table_args__ = (Index("ix_file_chunks_file_ordinal", "file_id", "ordinal"),)

    # An integer key: SQLite's FTS5 index refers to passages by rowid.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    ordinal: Mapped[int] = mapped_column(Integer)  # the passage's place in the file, from 0
    text: Mapped[str] = mapped_column(Text)
    char_start: Mapped[int] = mapped_column(Integer)  # where in the extracted text it begins and ends
    char_end: Mapped[int] = mapped_column(Integer)
    page: Mapped[int | None] = mapped_column(Integer)  # a PDF's page (from 1) the passage begins on
    embedding: Mapped[bytes | None] = mapped_column(LargeBinary)  # little-endian float32, unit length
    embedding_model: Mapped[str | None] = mapped_column(String(200))


class FileText(Base):
    """A file's whole extracted text, so that a citation opens its passage in context."""

    __tablename__ = "file_texts"

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # pdf | docx | html | markdown | code | text
    text: Mapped[str] = mapped_column(Text)


class Collection(Base):
    """A named set of a user's files that can be attached to many conversations."""

    __tablename__ = "collections"
    __table_args__ = (UniqueConstraint("user_id", "name", name="uq_collections_user_name"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("coll"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(100))
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CollectionFile(Base):
    __tablename__ = "collection_files"

    collection_id: Mapped[str] = mapped_column(ForeignKey("collections.id", ondelete="CASCADE"), primary_key=True)
    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True, index=True)


class ConversationFile(Base):
    """A file attached to one conversation (uploaded into it, or attached later)."""

    __tablename__ = "conversation_files"

    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"),
                                                 primary_key=True)
    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True, index=True)


class ConversationCollection(Base):
    __tablename__ = "conversation_collections"

    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"),
                                                 primary_key=True)
    collection_id: Mapped[str] = mapped_column(ForeignKey("collections.id", ondelete="CASCADE"), primary_key=True,
                                               index=True)
