"""Request bodies and response shapes of the account features: shared links, export and import,
custom instructions and memories, single sign-on."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from chatloom.app.api.schemas import STRICT, iso
from chatloom.store import Identity as IdentityRow
from chatloom.store import Memory, SharedLink


# -- shared links ----------------------------------------------------------------------------------

class ShareIn(BaseModel):
    model_config = STRICT
    message_id: str | None = Field(default=None, max_length=40,
                                   description="share the branch from the root up to this message; "
                                               "default: the active branch")


class ShareOut(BaseModel):
    id: str
    token: str
    url: str = Field(description="the public page, relative to the server: /s/{token}")
    conversation_id: str
    upto_message_id: str
    title: str
    message_count: int
    created: str | None

    @classmethod
    def of(cls, link: SharedLink) -> "ShareOut":
        return cls(id=link.id, token=link.token, url=f"/s/{link.token}", conversation_id=link.conversation_id,
                   upto_message_id=link.upto_message_id, title=link.title, message_count=len(link.messages),
                   created=iso(link.created))


class SharedMessage(BaseModel):
    role: str
    text: str
    created: str | None


class SharedConversation(BaseModel):
    """What anyone holding the link sees: the title and the shared messages, nothing else."""

    title: str
    created: str | None
    messages: list[SharedMessage]

    @classmethod
    def of(cls, link: SharedLink) -> "SharedConversation":
        return cls(title=link.title, created=iso(link.created),
                   messages=[SharedMessage(**m) for m in link.messages])


# -- export and import -----------------------------------------------------------------------------

class ExportMessage(BaseModel):
    id: str
    parent_id: str | None = Field(description="the message this one answers or follows; null for a root")
    role: Literal["user", "assistant"]
    text: str
    created: str | None = Field(description="ISO 8601, UTC")
    model: str | None = None
    status: str | None = None
    reasoning: str | None = None


class ExportConversation(BaseModel):
    id: str
    title: str
    created: str | None
    updated: str | None
    current_leaf_id: str | None = Field(description="the message the conversation was left at (its active branch)")
    messages: list[ExportMessage] = Field(description="every message of every branch, oldest first")


class ExportFile(BaseModel):
    """chatloom's export: every branch of every conversation; POST /conversations/import reads it back."""

    format: Literal["chatloom.conversations"]
    version: Literal[1]
    exported: str | None
    conversations: list[ExportConversation]


class ImportOut(BaseModel):
    format: Literal["chatloom", "chatgpt"] = Field(description="what the file was found to be")
    conversation_ids: list[str] = Field(description="the new conversations, in the file's order")
    messages: int = Field(description="messages imported (ChatGPT's system and tool messages are left out)")


# -- custom instructions and memories --------------------------------------------------------------

class InstructionsIn(BaseModel):
    model_config = STRICT
    text: str = Field(max_length=20_000, description="empty to clear them")


class InstructionsOut(BaseModel):
    text: str


class MemoryIn(BaseModel):
    model_config = STRICT
    text: str = Field(min_length=1, max_length=20_000)


class MemoryOut(BaseModel):
    id: str
    text: str
    status: Literal["active", "proposed"] = Field(description="proposed: suggested by the model, not yet "
                                                             "confirmed, not in the prompt")
    source_conversation_id: str | None
    created: str | None
    updated: str | None

    @classmethod
    def of(cls, m: Memory) -> "MemoryOut":
        return cls(id=m.id, text=m.text, status=m.status, source_conversation_id=m.source_conversation_id,
                   created=iso(m.created), updated=iso(m.updated))


# -- single sign-on ---------------------------------------------------------------------------------

class SsoInfo(BaseModel):
    """What the login screen offers."""

    enabled: bool = Field(description="single sign-on is offered: GET /auth/sso/login starts it")
    label: str | None = Field(description="the text of its button")
    local_login: bool = Field(description="username and password sign-in (and sign-up) are available")


class SsoConnectOut(BaseModel):
    """A connecting flow, begun: send the browser to `url`; the state cookie that binds it was set."""

    url: str = Field(description="the identity provider's authorization URL")


class LinkedIdentityOut(BaseModel):
    """An identity at the provider that signs in to this account."""

    id: str
    issuer: str
    email: str | None = Field(description="the email the provider gave at the last connect or sign-in")
    created: str | None = Field(description="when it was linked")
    last_login: str | None = Field(description="its last single sign-on to this account")

    @classmethod
    def of(cls, row: IdentityRow) -> "LinkedIdentityOut":
        return cls(id=row.id, issuer=row.issuer, email=row.email, created=iso(row.created),
                   last_login=iso(row.last_login))
