"""Continuing an interrupted answer: POST /conversations/{id}/messages/{message_id}/continue (SSE).

Kept apart from the conversation routes: the recovery feature (app/recovery.py) in one place.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.auth import current_user
from chatloom.app.conversation_service import GenerationOptions
from chatloom.app.deps import get_context, get_session
from chatloom.app.recovery import continue_answer
from chatloom.app.routes.conversations import owned_conversation, stream_response
from chatloom.app.schemas import GenerationIn
from chatloom.store import Conversation, User

router = APIRouter(prefix="/conversations", tags=["conversations"])


@router.post("/{conversation_id}/messages/{message_id}/continue")
async def continue_message(message_id: str, request: Request, body: GenerationIn | None = None,
                           conv: Conversation = Depends(owned_conversation),
                           session: AsyncSession = Depends(get_session),
                           user: User = Depends(current_user)) -> StreamingResponse:
    """Resume an interrupted (or stopped, or cut-off) answer from its saved text, in the same message.
    The stream's first token event repeats the saved text, so a reader can render it whole."""
    options = GenerationOptions(body.model, body.max_tokens, body.temperature, user, body.reasoning_effort) \
        if body else GenerationOptions(user=user)
    gen = await continue_answer(get_context(request).conversations, session, conv, message_id, options)
    return stream_response(gen)
