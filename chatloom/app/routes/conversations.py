"""The conversation API: list, create, read a branch, rename, delete; send, regenerate, stop (SSE)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.auth import current_user
from chatloom.app.branches import Tree
from chatloom.app.conversation_service import UNSET, Generation, GenerationOptions
from chatloom.app.deps import get_context, get_session
from chatloom.app.errors import ApiError, not_found
from chatloom.app.hotstate.stop_relay import stop_anywhere
from chatloom.app.schemas import (ConversationIn, GenerationIn, MessageIn, RenameIn, conversation_summary,
                                  message_out)
from chatloom.app.sse import HEARTBEAT, SSE_HEADERS, frame_event
from chatloom.store import Conversation, Conversations, Messages, User

router = APIRouter(prefix="/conversations", tags=["conversations"])

HEARTBEAT_S = 15.0


async def owned_conversation(conversation_id: str, user: User = Depends(current_user),
                             session: AsyncSession = Depends(get_session)) -> Conversation:
    """The path's conversation if the caller owns it; someone else's is a 404 like a missing one."""
    conv = await Conversations(session).get_owned(user.id, conversation_id)
    if conv is None:
        raise not_found("conversation")
    return conv


def stream_response(gen: Generation) -> StreamingResponse:
    """SSE from the generation's event log. Leaving early only stops this reader, not the generation."""
    async def events():
        async for ev in gen.log.read(0, heartbeat_s=HEARTBEAT_S):
            yield HEARTBEAT if ev is None else frame_event(ev)

    headers = {**SSE_HEADERS, "X-Conversation-Id": gen.conversation_id, "X-Message-Id": gen.message_id,
               "X-User-Message-Id": gen.user_message_id}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


@router.get("")
async def list_conversations(limit: int = Query(20, ge=1, le=100), offset: int = Query(0, ge=0),
                             user: User = Depends(current_user),
                             session: AsyncSession = Depends(get_session)) -> list:
    """Newest first."""
    return [conversation_summary(c) for c in await Conversations(session).page(user.id, limit, offset)]


@router.post("", status_code=201)
async def create_conversation(body: ConversationIn | None = None, user: User = Depends(current_user),
                              session: AsyncSession = Depends(get_session)) -> dict:
    title = body.title.strip() if body and body.title and body.title.strip() else None
    conv = await Conversations(session).create(user.id, title)
    await session.commit()
    return conversation_summary(conv)


@router.get("/{conversation_id}")
async def read_conversation(request: Request, leaf: str | None = Query(None, max_length=40),
                            conv: Conversation = Depends(owned_conversation),
                            session: AsyncSession = Depends(get_session)) -> dict:
    """The active branch (or the branch through ?leaf=MESSAGE_ID), each message with its siblings."""
    tree = Tree(await Messages(session).all_in(conv.id))
    if leaf is not None and leaf not in tree:
        raise ApiError(404, f"message {leaf!r} is not in this conversation", "message_not_found", "leaf")
    branch = tree.branch(leaf if leaf is not None else tree.default_leaf(conv.current_leaf_id))
    running = get_context(request).conversations.running(conv.id)
    return {**conversation_summary(conv), "summary": conv.summary, "summary_upto": conv.summary_upto,
            "generating": running.message_id if running else None,
            "messages": [message_out(m, tree.siblings(m)) for m in branch]}


@router.patch("/{conversation_id}")
async def rename_conversation(body: RenameIn, conv: Conversation = Depends(owned_conversation),
                              session: AsyncSession = Depends(get_session)) -> dict:
    await Conversations(session).touch(conv.id, title=body.title)
    await session.commit()
    await session.refresh(conv)
    return conversation_summary(conv)


@router.delete("/{conversation_id}", status_code=204)
async def delete_conversation(request: Request, conv: Conversation = Depends(owned_conversation),
                              session: AsyncSession = Depends(get_session)) -> Response:
    await _stop(request, conv.id)
    await Conversations(session).delete(conv.id)
    await session.commit()
    return Response(status_code=204)


@router.post("/{conversation_id}/messages")
async def send_message(body: MessageIn, request: Request, conv: Conversation = Depends(owned_conversation),
                       session: AsyncSession = Depends(get_session),
                       user: User = Depends(current_user)) -> StreamingResponse:
    """Save the message and stream the answer: data: {"token"} events, then data: {"done": true, ...}.
    Omit parent_id to continue the active branch; give an earlier assistant message's id (or null
    for the first message) to branch off, as an edit does."""
    parent = body.parent_id if "parent_id" in body.model_fields_set else UNSET
    options = GenerationOptions(body.model, body.max_tokens, body.temperature, user, body.reasoning_effort)
    gen = await get_context(request).conversations.send(session, conv, body.text, parent, options)
    return stream_response(gen)


@router.post("/{conversation_id}/messages/{message_id}/regenerate")
async def regenerate(message_id: str, request: Request, body: GenerationIn | None = None,
                     conv: Conversation = Depends(owned_conversation),
                     session: AsyncSession = Depends(get_session),
                     user: User = Depends(current_user)) -> StreamingResponse:
    """Stream a new answer beside an assistant message (or a new answer to a user message)."""
    options = GenerationOptions(body.model, body.max_tokens, body.temperature, user, body.reasoning_effort) \
        if body else GenerationOptions(user=user)
    gen = await get_context(request).conversations.regenerate(session, conv, message_id, options)
    return stream_response(gen)


@router.post("/{conversation_id}/stop")
async def stop(request: Request, conv: Conversation = Depends(owned_conversation)) -> dict:
    """Abort the running answer (on whichever gateway runs it); returns once the partial answer is saved
    as 'stopped'."""
    message_id = await _stop(request, conv.id)
    return {"stopped": message_id is not None, "message_id": message_id}


async def _stop(request: Request, conversation_id: str) -> str | None:
    ctx, hot = get_context(request), request.app.state.hot
    return await stop_anywhere(conversation_id, ctx.conversations.stop, hot.jobs, hot.stops, ctx.conversations.logs)
