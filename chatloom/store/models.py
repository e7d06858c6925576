"""Tables. Portable SQL only: the same models run on SQLite and PostgreSQL."""
from __future__ import annotations

import os
import threading
import time
from datetime import datetime, timezone

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, ForeignKey, Index, Integer, MetaData, String, Text,
                        UniqueConstraint, false)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Named constraints keep future Alembic migrations (and SQLite batch mode) predictable.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# interrupted: the process writing the answer died or shut down first; the text so far is kept.
MESSAGE_STATUSES = ("complete", "incomplete", "stopped", "error", "interrupted")

_id_lock = threading.Lock()
_last_ms = 0
_seq = 0


def new_id(prefix: str) -> str:
    """A short id that sorts by creation time: milliseconds, a counter within the ms, randomness.
    Sortable ids give siblings and pages a stable order even when timestamps tie."""
    global _last_ms, _seq
    with _id_lock:
        ms = int(time.time() * 1000)
        if ms <= _last_ms:
            _seq += 1
            ms = _last_ms
        else:
            _seq = 0
        _last_ms = ms
        seq = _seq
    return f"{prefix}_{ms:011x}{seq:04x}{os.urandom(5).hex()}"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class User(Base):
    __tablename__ = "users"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("usr"))
    username: Mapped[str] = mapped_column(String(64), unique=True)
    # NULL: the account cannot log in with a password (created by `chatloom keys create --create-user`).
    password_hash: Mapped[str | None] = mapped_column(String(255))
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    tier: Mapped[str] = mapped_column(String(32), default="free", server_default="free")
    # Lower-cased; set by single sign-on, so a person signing in again by another route finds this account.
    email: Mapped[str | None] = mapped_column(String(255), unique=True)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Carried by every session token; raised to sign the account out everywhere at once.
    session_version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100), default="", server_default="")
    prefix: Mapped[str] = mapped_column(String(16))  # first characters, so a user can tell keys apart
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_used: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # What the key may do, space-separated (read, chat, admin: app/core/scopes.py); keys made before
    # scopes existed keep every right their owner has.
    scopes: Mapped[str] = mapped_column(String(64), default="read chat", server_default="read chat admin")
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # None: never


class Conversation(Base):
    __tablename__ = "conversations"
    __table_args__ = (Index("ix_conversations_user_updated", "user_id", "updated"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("conv"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    title: Mapped[str | None] = mapped_column(String(200))
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # The leaf of the branch shown by default: the newest message written or regenerated.
    current_leaf_id: Mapped[str | None] = mapped_column(String(40))
    # A model-written summary of the branch from the root up to and including summary_upto.
    summary: Mapped[str | None] = mapped_column(Text)
    summary_upto: Mapped[str | None] = mapped_column(String(40))


class Message(Base):
    __tablename__ = "messages"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("msg"))
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"), index=True)
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("messages.id", ondelete="CASCADE"), index=True)
    role: Mapped[str] = mapped_column(String(16))  # user | assistant
    text: Mapped[str] = mapped_column(Text, default="")
    tokens: Mapped[int] = mapped_column(Integer, default=0)  # tokens of `text` alone, for prompt assembly
    model: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="complete")  # one of MESSAGE_STATUSES
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)  # what the answer's prompt cost
    completion_tokens: Mapped[int | None] = mapped_column(Integer)  # what the answer generated (metered)
    reasoning: Mapped[str | None] = mapped_column(Text)  # the thinking before the answer (reasoning requests)
    # While an answer is written: when its writer began it (or, for answers of versions before `writer`
    # existed, last saved it). Only answers with no writer are judged by its age.
    heartbeat: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The gateway process (instance id, unique per start) writing the answer, so an answer left by a dead
    # process is known exactly: its writer is not this process (alone) or not alive in Redis (a fleet).
    writer: Mapped[str | None] = mapped_column(String(120))
    interrupted_reason: Mapped[str | None] = mapped_column(Text)
    # The answer's tool steps, in order: [{"id", "name", "arguments", "output", "error"}] (chat tools).
    tool_steps: Mapped[list | None] = mapped_column(JSON)
    # The passages of uploaded files the answer's prompt held: [{"n", "file_id", "filename", "chunk_id",
    # "ordinal", "page", "char_start", "char_end", "text"}] (app/files/retrieval.py).
    citations: Mapped[list | None] = mapped_column(JSON)
    # A user message's Idempotency-Key (the sender's own name for this send): a send repeated after a lost
    # reply finds the message the first one stored instead of storing, answering and billing it twice.
    client_key: Mapped[str | None] = mapped_column(String(100))
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (Index("uq_messages_conversation_client_key", "conversation_id", "client_key", unique=True),)


class AnswerChunk(Base):
    """Answer text appended while it streams, one row per flush (an engine step's pieces, or several
    steps' when the database is slower than the engine), written before any client is sent that text.
    An answer that ends folds its rows into its message and deletes them; so does recovery."""

    __tablename__ = "answer_chunks"

    # The order of appends. BIGINT on PostgreSQL (rows come and go at every streamed step for the
    # service's lifetime); INTEGER PRIMARY KEY on SQLite, its auto-incrementing row id.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    message_id: Mapped[str] = mapped_column(ForeignKey("messages.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # text | reasoning
    text: Mapped[str] = mapped_column(Text)
    tokens: Mapped[int] = mapped_column(Integer, default=0)  # model tokens this row's text took


class DailyUsage(Base):
    """Tokens metered per user, UTC day and model (one row each, added to as generations end)."""

    __tablename__ = "usage"
    __table_args__ = (UniqueConstraint("user_id", "day", "model", name="uq_usage_user_day_model"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    day: Mapped[str] = mapped_column(String(10), index=True)  # YYYY-MM-DD, UTC
    model: Mapped[str] = mapped_column(String(200))
    requests: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)  # prompt tokens served from the prefix cache


class Feedback(Base):
    """A user's thumbs up or down (and optional words) on an answer; one per user and message."""

    __tablename__ = "feedback"
    __table_args__ = (UniqueConstraint("message_id", "user_id", name="uq_feedback_message_user"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("fb"))
    message_id: Mapped[str] = mapped_column(ForeignKey("messages.id", ondelete="CASCADE"), index=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    rating: Mapped[str] = mapped_column(String(8))  # up | down
    text: Mapped[str | None] = mapped_column(Text)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


# What an uploaded file is for, as OpenAI's files API names it: batch input, batch results, files a
# user gives the chat (retrieval, attachments), images.
FILE_PURPOSES = ("batch", "batch_output", "user_data", "assistants", "vision")


class StoredFile(Base):
    """An uploaded (or produced) file. Its bytes live in the blob store under `blob_key`; deleting a
    file removes the row and the blob together (store/blobs.py)."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_user_created", "user_id", "created"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("file"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    content_type: Mapped[str | None] = mapped_column(String(128))
    bytes: Mapped[int] = mapped_column(BigInteger)
    blob_key: Mapped[str] = mapped_column(String(255), unique=True)
    sha256: Mapped[str | None] = mapped_column(String(64))
    # uploaded: bytes stored; processed: whatever the purpose needs done to it is done; error: that failed.
    status: Mapped[str] = mapped_column(String(16), default="uploaded")
    status_details: Mapped[str | None] = mapped_column(Text)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
