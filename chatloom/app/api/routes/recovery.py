"""Continuing an interrupted answer: POST /conversations/{id}/messages/{message_id}/continue (SSE).

Kept apart from the conversation routes: the recovery feature (chat/recovery.py) in one place.
"""
from __future__ import annotations

from fastapi import APIRouter

from chatloom.app.api.deps import Ctx, CurrentUser, OwnedConversation, SessionDep
from chatloom.app.api.openapi_responses import ANSWER_STREAM, CONVERSATION_ANSWER
from chatloom.app.chat.recovery import continue_answer
from chatloom.app.api.routes.conversations import _options, stream_response
from chatloom.app.api.sse import EventStreamResponse
from chatloom.app.api.schemas import GenerationIn

router = APIRouter(prefix="/conversations", tags=["conversations"])


@router.post("/{conversation_id}/messages/{message_id}/continue", response_class=EventStreamResponse,
             responses=ANSWER_STREAM | CONVERSATION_ANSWER)
async def continue_message(message_id: str, ctx: Ctx, conv: OwnedConversation, session: SessionDep,
                           user: CurrentUser, body: GenerationIn | None = None) -> EventStreamResponse:
    """Resume an interrupted (or stopped, or cut-off) answer from its saved text, in the same message.
    The stream's first token event repeats the saved text, so a reader can render it whole."""
    gen = await continue_answer(ctx.conversations, session, conv, message_id, _options(user, body))
    return stream_response(gen)
