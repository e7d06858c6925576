"""Request bodies and response shapes of the product API (the `response_model`s, so the OpenAPI
schema says what each route returns)."""
from __future__ import annotations

from datetime import datetime, timezone

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator

from chatloom.store import ApiKey, Conversation, Message, User

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
    scopes: list[Literal["read", "chat", "admin"]] = Field(
        default=["read", "chat"], min_length=1, description="What the key may do: read (GET requests), chat (every "
                                                            "other request outside /admin), admin (/admin; admins only).")
    expires_in_days: int | None = Field(default=None, ge=1, le=3650, description="The key stops working after "
                                                                                 "this many days; none: never "
                                                                                 "(unless the server caps it).")


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
    # Images shown with the message (data URLs), for a model that reads images; kept in the conversation.
    images: list[str] = Field(default_factory=list, max_length=64)

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


# -- responses ----------------------------------------------------------------------------

class UserOut(BaseModel):
    id: str
    username: str
    is_admin: bool
    tier: str

    @classmethod
    def of(cls, user: User) -> "UserOut":
        return cls(id=user.id, username=user.username, is_admin=user.is_admin, tier=user.tier)


class SessionOut(BaseModel):
    token: str
    user: UserOut


class ApiKeyOut(BaseModel):
    id: str
    name: str
    prefix: str
    created: str | None
    last_used: str | None
    scopes: list[str]
    expires_at: str | None

    @classmethod
    def of(cls, k: ApiKey) -> "ApiKeyOut":
        return cls(id=k.id, name=k.name, prefix=k.prefix, created=iso(k.created), last_used=iso(k.last_used),
                   scopes=k.scopes.split(), expires_at=iso(k.expires_at))


class ApiKeyCreated(ApiKeyOut):
    key: str  # shown this once


class ConversationOut(BaseModel):
    id: str
    title: str
    created: str | None
    updated: str | None

    @classmethod
    def of(cls, conv: Conversation) -> "ConversationOut":
        return cls(id=conv.id, title=conv.title or "New chat", created=iso(conv.created), updated=iso(conv.updated))


class ConversationHit(ConversationOut):
    """A search result (GET /conversations?q=): the conversation, its best match as HTML (escaped text,
    matched words in <mark>), and the message it is in (None: the title matched)."""

    snippet: str
    message_id: str | None

    @classmethod
    def hit(cls, conv: Conversation, snippet: str, message_id: str | None) -> "ConversationHit":
        return cls(**ConversationOut.of(conv).model_dump(), snippet=snippet, message_id=message_id)


class MessageOut(BaseModel):
    id: str
    parent_id: str | None
    role: str
    text: str
    reasoning: str | None = None  # the thinking of a reasoning answer
    # Tool calls the answer made and their results, in order: {id, name, arguments, output, error}.
    tool_steps: list[dict] | None = None
    # Passages of the user's files the answer's prompt held, numbered as the answer cites them ([1]...):
    # {n, file_id, filename, chunk_id, ordinal, page, char_start, char_end, text}.
    citations: list[dict] | None = None
    tokens: int
    model: str | None
    status: str
    finish_reason: str | None
    created: str | None
    sibling_ids: list[str]
    sibling_index: int
    feedback: Literal["up", "down"] | None = None  # the caller's rating of this answer
    error: str | None = None
    # status 'interrupted': the server stopped while writing it; it can be continued or regenerated.
    interrupted_reason: str | None = None
    # The ids of the images a user message carries, in order (their bytes: GET /v1/files/{id}/content).
    images: list[str] = []

    @classmethod
    def of(cls, m: Message, siblings: list[Message], feedback: str | None = None,
           images: list[str] | None = None) -> "MessageOut":
        ids = [s.id for s in siblings]
        return cls(id=m.id, parent_id=m.parent_id, role=m.role, text=m.text, reasoning=m.reasoning,
                   tool_steps=m.tool_steps, citations=m.citations,
                   tokens=m.tokens, model=m.model, status=m.status, finish_reason=m.finish_reason,
                   created=iso(m.created), sibling_ids=ids, sibling_index=ids.index(m.id), feedback=feedback,
                   error=m.error or None, interrupted_reason=m.interrupted_reason, images=images or [])


class ConversationDetail(ConversationOut):
    summary: str | None
    summary_upto: str | None
    generating: str | None  # the id of the answer being written now, if any
    messages: list[MessageOut]


class StopOut(BaseModel):
    stopped: bool
    message_id: str | None


# -- the events of an answer's stream (text/event-stream; each event's data is one of these, as JSON) ----

class TokenEvent(BaseModel):
    token: str  # the next piece of the answer's text


class ThinkingEvent(BaseModel):
    thinking: str  # the next piece of a reasoning answer's hidden thinking


class QueuePositionEvent(BaseModel):
    queue_position: int  # the answer's place in the admission queue, when it changes


class ToolCallData(BaseModel):
    id: str
    name: str
    arguments: str


class ToolCallEvent(BaseModel):
    tool_call: ToolCallData


class ToolResultData(BaseModel):
    id: str
    name: str
    output: str
    error: str | None


class ToolResultEvent(BaseModel):
    tool_result: ToolResultData


class StreamUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class DoneEvent(BaseModel):
    """The last event of a finished answer."""

    done: Literal[True]
    message_id: str
    user_message_id: str | None
    conversation_id: str
    status: str
    finish_reason: str | None
    usage: StreamUsage


class StreamErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None
    status: int  # what the HTTP status would have been, had the failure come before the stream began


class ErrorEvent(BaseModel):
    """`event: error`: the answer failed or was refused after its stream began (queue full or timed out,
    generation failed); the last event."""

    error: StreamErrorDetail
    retry_after: int | None = None
    message_id: str | None = None


class AnswerEvent(RootModel[TokenEvent | ThinkingEvent | QueuePositionEvent | ToolCallEvent | ToolResultEvent
                            | DoneEvent | ErrorEvent]):
    """The data of one event of an answer's stream."""
