"""FastAPI dependencies: the shared application context and one DB session per request."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.settings import Settings
from chatloom.serving import Backend
from chatloom.store import Database

if TYPE_CHECKING:
    from chatloom.app.auth import Passwords, Tokens
    from chatloom.app.conversation_service import ConversationService
    from chatloom.app.traffic import Traffic


@dataclass
class AppContext:
    """Everything the routes share, built once by create_app."""

    settings: Settings
    db: Database
    backend: Backend
    passwords: "Passwords"
    tokens: "Tokens"
    conversations: "ConversationService"
    traffic: "Traffic | None" = None


def get_context(request: Request) -> AppContext:
    return request.app.state.ctx


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """A session for this request; whatever was not committed is rolled back when it closes."""
    async with get_context(request).db.session() as session:
        yield session
