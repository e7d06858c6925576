"""Request bodies and response shapes of the product API."""
from __future__ import annotations

from datetime import datetime, timezone

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chatloom.store import ApiKey, Conversation, Message

# Product requests reject unknown fields (a typo like "parent" should not be silently ignored)
# and do not coerce types ("text": 5 is an error, not "5").
STRICT = ConfigDict(extra="forbid", strict=True)


class Credentials(BaseModel):
    model_config = STRICT
    username: str = Field(min_length=3, max_length=32, pattern=r"^[A-Za-z0-9_.-]+$")
    password: str = Field(min_length=8, max_length=256)


class LoginIn(BaseModel):
    model_config = STRICT
    username: str = Field(min_length=1, max_length=64)
    password: str = Field(min_length=1, max_length=256)


class ApiKeyIn(BaseModel):
    model_config = STRICT
    name: str = Field(default="", max_length=100)


class ConversationIn(BaseModel):
    model_config = STRICT
    title: str | None = Field(default=None, max_length=200)


class RenameIn(BaseModel):
    model_config = STRICT
    title: str = Field(max_length=200)

    @field_validator("title")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("title must not be empty")
        return v


class GenerationIn(BaseModel):
    model_config = STRICT
    model: str | None = Field(default=None, max_length=200)
    max_tokens: int | None = Field(default=None, ge=1)
    # Ints are fine for a float ("temperature": 1) even in strict mode.
    temperature: float | None = Field(default=None, ge=0, le=2)
    # Think before answering, with a thinking budget set by the effort (a separate queue class).
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class MessageIn(GenerationIn):
    text: str
    parent_id: str | None = Field(default=None, max_length=40)

    @field_validator("text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("text must not be empty")
        return v


def iso(dt: datetime | None) -> str | None:
    """UTC timestamps with a Z; SQLite hands back naive datetimes, all of which are UTC."""
    if dt is None:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def conversation_summary(conv: Conversation) -> dict:
    return {"id": conv.id, "title": conv.title or "New chat", "created": iso(conv.created),
            "updated": iso(conv.updated)}


def message_out(m: Message, siblings: list[Message]) -> dict:
    ids = [s.id for s in siblings]
    out = {"id": m.id, "parent_id": m.parent_id, "role": m.role, "text": m.text, "tokens": m.tokens,
           "model": m.model, "status": m.status, "finish_reason": m.finish_reason, "created": iso(m.created),
           "sibling_ids": ids, "sibling_index": ids.index(m.id)}
    if m.error:
        out["error"] = m.error
    if m.interrupted_reason:  # status 'interrupted': why (the answer can be continued or regenerated)
        out["interrupted_reason"] = m.interrupted_reason
    return out


def api_key_out(k: ApiKey) -> dict:
    return {"id": k.id, "name": k.name, "prefix": k.prefix, "created": iso(k.created),
            "last_used": iso(k.last_used)}
