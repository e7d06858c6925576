"""What an account keeps beside its conversations: shared links, sign-in identities from an OpenID
Connect provider, custom instructions and remembered facts."""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, DateTime, ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from chatloom.store.models import Base, new_id, utcnow


class SharedLink(Base):
    """A read-only link to a conversation as it was when shared. `messages` is a copy of the shared branch
    (role, text, created), so nothing written later, no other branch and no file can be read through it."""

    __tablename__ = "shared_links"
    __table_args__ = (Index("ix_shared_links_user_created", "user_id", "created"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("shr"))
    # secrets.token_urlsafe(32): 256 random bits, the link's only credential.
    token: Mapped[str] = mapped_column(String(64), unique=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"), index=True)
    upto_message_id: Mapped[str] = mapped_column(String(40))  # the last message shared
    title: Mapped[str] = mapped_column(String(200))
    messages: Mapped[list] = mapped_column(JSON)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Identity(Base):
    """An account's identity at an OpenID Connect provider: (issuer, subject) names one person for good."""

    __tablename__ = "identities"
    __table_args__ = (UniqueConstraint("issuer", "subject", name="uq_identities_issuer_subject"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("idn"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    issuer: Mapped[str] = mapped_column(String(255))
    subject: Mapped[str] = mapped_column(String(255))
    email: Mapped[str | None] = mapped_column(String(255))
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_login: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class CustomInstructions(Base):
    """What a user wants every answer to know or follow; one row per user."""

    __tablename__ = "custom_instructions"

    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), primary_key=True)
    text: Mapped[str] = mapped_column(Text, default="")
    updated: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


# active: placed in the system prompt; proposed: suggested by the model, waiting for the user's yes.
MEMORY_STATUSES = ("active", "proposed")


class Memory(Base):
    """A fact a user asked the assistant to remember (or confirmed when the model proposed it)."""

    __tablename__ = "memories"
    __table_args__ = (Index("ix_memories_user_created", "user_id", "created"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("mem"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    text: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="active")
    # Where the model proposed it; not a foreign key: deleting the conversation keeps the memory.
    source_conversation_id: Mapped[str | None] = mapped_column(String(40))
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
