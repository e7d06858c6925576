"""The conversation API: list, create, read a branch, rename, delete; send, regenerate, stop, and
resume a stream from any event id (all answers stream as SSE from the generation's event log)."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from fastapi import APIRouter, Header, Query, Response
from sqlalchemy import select

from chatloom.app.chat import resend
from chatloom.app.chat.message_images import image_ids
from chatloom.app.core.image_input import ImageReader, reading_images, require_vision
from chatloom.app.chat.branches import Tree
from chatloom.app.chat.conversation_service import UNSET, Generation, GenerationOptions
from chatloom.app.chat.search import search_conversations
from chatloom.app.api.deps import Ctx, CurrentUser, OwnedConversation, SessionDep
from chatloom.app.core.errors import ApiError
from chatloom.app.state.events import EventLog
from chatloom.app.tools.sandbox import remove_scratch
from chatloom.app.state.stop_relay import stop_anywhere
from chatloom.app.api.schemas import (ConversationDetail, ConversationHit, ConversationIn, ConversationOut, GenerationIn,
                                      MessageIn, MessageOut, RenameIn, StopOut)
from chatloom.app.api.openapi_responses import ANSWER_STREAM, CONVERSATION_ANSWER, OWN_CONVERSATION, SIGNED_IN, errors
from chatloom.app.api.sse import HEARTBEAT, SSE_HEADERS, EventStreamResponse, frame_event
from chatloom.app.core.validation import Offset
from chatloom.store import Conversations, FeedbackRows, Message, Messages

router = APIRouter(prefix="/conversations", tags=["conversations"])

HEARTBEAT_S = 15.0


def _sse(log: EventLog, after: int, headers: dict[str, str]) -> EventStreamResponse:
    """SSE from an event log. Leaving early only stops this reader, not the generation."""
    async def events():
        async for ev in log.read(after, heartbeat_s=HEARTBEAT_S):
            yield HEARTBEAT if ev is None else frame_event(ev)

    return EventStreamResponse(events(), headers={**SSE_HEADERS, **headers})


def stream_response(gen: Generation) -> EventStreamResponse:
    return _sse(gen.log, 0, {"X-Conversation-Id": gen.conversation_id, "X-Message-Id": gen.message_id,
                             "X-User-Message-Id": gen.user_message_id})


@router.get("", response_model=list[ConversationHit] | list[ConversationOut], responses=SIGNED_IN)
async def list_conversations(user: CurrentUser, session: SessionDep, limit: int = Query(20, ge=1, le=100),
                             offset: Offset = 0,
                             q: str | None = Query(None, max_length=500, description=(
                                 "Search the caller's titles and messages (every branch): every word must "
                                 "match, the last as a prefix; best match first, each with a snippet."))
                             ) -> list[ConversationHit] | list[ConversationOut]:
    """Newest first; with `q`, the conversations matching it, best first, with highlighted snippets."""
    if q is not None and q.strip():
        return [ConversationHit.hit(h.conversation, h.snippet, h.message_id)
                for h in await search_conversations(session, user.id, q, limit, offset)]
    return [ConversationOut.of(c) for c in await Conversations(session).page(user.id, limit, offset)]


@router.post("", status_code=201, response_model=ConversationOut, responses=SIGNED_IN)
async def create_conversation(user: CurrentUser, session: SessionDep,
                              body: ConversationIn | None = None) -> ConversationOut:
    title = body.title.strip() if body and body.title and body.title.strip() else None
    conv = await Conversations(session).create(user.id, title)
    await session.commit()
    return ConversationOut.of(conv)


@router.get("/{conversation_id}", response_model=ConversationDetail, responses=OWN_CONVERSATION)
async def read_conversation(ctx: Ctx, conv: OwnedConversation, user: CurrentUser, session: SessionDep,
                            leaf: str | None = Query(None, max_length=40)) -> ConversationDetail:
    """The active branch (or the branch through ?leaf=MESSAGE_ID), each message with its siblings,
    its reasoning and the caller's feedback on it."""
    tree = Tree(await Messages(session).all_in(conv.id))
    if leaf is not None and leaf not in tree:
        raise ApiError(404, f"message {leaf!r} is not in this conversation", "message_not_found", "leaf")
    branch = tree.branch(leaf if leaf is not None else tree.default_leaf(conv.current_leaf_id))
    ratings = await FeedbackRows(session).ratings(user.id, [m.id for m in branch if m.role == "assistant"])
    running = ctx.conversations.running(conv.id)
    images = await image_ids(session, [m.id for m in branch if m.role == "user"])
    return ConversationDetail(
        **ConversationOut.of(conv).model_dump(), summary=conv.summary, summary_upto=conv.summary_upto,
        generating=running.message_id if running else None,
        messages=[MessageOut.of(m, tree.siblings(m), ratings[m.id].rating if m.id in ratings else None,
                                images.get(m.id)) for m in branch])


@router.patch("/{conversation_id}", response_model=ConversationOut, responses=OWN_CONVERSATION)
async def rename_conversation(body: RenameIn, conv: OwnedConversation, session: SessionDep) -> ConversationOut:
    await Conversations(session).touch(conv.id, title=body.title)
    await session.commit()
    await session.refresh(conv)
    return ConversationOut.of(conv)


@router.delete("/{conversation_id}", status_code=204, responses=OWN_CONVERSATION | errors(503))
async def delete_conversation(ctx: Ctx, conv: OwnedConversation, session: SessionDep) -> Response:
    await _stop(ctx, conv.id)
    await ctx.files.delete_for_conversation(session, conv.user_id, conv.id)  # the files only it held, for good
    await Conversations(session).delete(conv.id)
    await session.commit()
    await asyncio.to_thread(remove_scratch, ctx.settings.server.data_dir, conv.id)  # the code interpreter's files
    return Response(status_code=204)


def _options(user, body: GenerationIn | None) -> GenerationOptions:
    if body is None:
        return GenerationOptions(user)
    return GenerationOptions(user, body.model, body.max_tokens, body.temperature, body.reasoning_effort)


@router.post("/{conversation_id}/messages", response_class=EventStreamResponse,
             responses=ANSWER_STREAM | CONVERSATION_ANSWER | errors(400, 422))
async def send_message(body: MessageIn, ctx: Ctx, conv: OwnedConversation, session: SessionDep,
                       user: CurrentUser, idempotency_key: str | None = Header(
                           None, alias=resend.HEADER,
                           description="The sender's name for this send (a UUID, say): sent again with the same "
                                       "key after a lost reply, the message is stored and answered once, and the "
                                       "repeat streams the first send's answer from its start.")
                       ) -> EventStreamResponse:
    """Save the message and stream the answer: data: {"token"} events, then data: {"done": true, ...}.
    Omit parent_id to continue the active branch; give an earlier assistant message's id (or null
    for the first message) to branch off, as an edit does. `images` (data URLs) are shown to a model that
    reads images, before the text, and stay with the message for the rest of the conversation."""
    key, conversation_id = resend.checked_key(idempotency_key), conv.id

    async def start() -> Generation:
        parent = body.parent_id if "parent_id" in body.model_fields_set else UNSET
        images = []
        if body.images:  # read and checked before anything is saved
            require_vision(ctx.backend, body.model)
            reader = ImageReader(ctx.settings.vision, "images")
            await reader.fetch(body.images)
            images = await reading_images(True, lambda: [reader.data_url(url) for url in body.images])
        return await ctx.conversations.send(session, conv, body.text, _options(user, body), parent, images, key)

    return await _answer_once(ctx, session, conversation_id, key,
                              lambda: resend.earlier_send(session, conversation_id, key, body.text), start,
                              "this message was sent by another request at the same time")


async def _answer_once(ctx: Ctx, session: SessionDep, conversation_id: str, key: str | None,
                       earlier: Callable[[], Awaitable[tuple[str, str] | None]],
                       start: Callable[[], Awaitable[Generation]], raced: str) -> EventStreamResponse:
    """One answer per Idempotency-Key: a key seen before (`earlier` finds its request's user message and
    answer) replays that answer; otherwise `start` begins a new one, and where a concurrent request
    stored the same key first (AlreadySent) its answer is replayed instead, or 409 `raced` if it is
    gone already."""
    if key is not None and (found := await earlier()):
        return await _replay(ctx, session, conversation_id, *found)
    try:
        gen = await start()
    except resend.AlreadySent:
        found = await earlier()
        if found is None:  # deleted in between
            raise ApiError(409, raced, "already_sent", resend.HEADER) from None
        return await _replay(ctx, session, conversation_id, *found)
    return stream_response(gen)


async def _replay(ctx: Ctx, session: SessionDep, conversation_id: str, user_message_id: str,
                  answer_id: str) -> EventStreamResponse:
    """A repeated send's (or regeneration's) reply: the first one's answer, streamed from its first event."""
    await session.close()  # a long-lived stream must not hold a database connection
    log = await ctx.conversations.logs.get(answer_id)
    if log is None:
        raise ApiError(409, "this request was already answered, and its answer's stream is no longer "
                       f"kept: read the conversation for answer {answer_id}", "already_sent", resend.HEADER)
    return _sse(log, 0, {"X-Conversation-Id": conversation_id, "X-Message-Id": answer_id,
                         "X-User-Message-Id": user_message_id, "Idempotent-Replayed": "true"})


@router.post("/{conversation_id}/messages/{message_id}/regenerate", response_class=EventStreamResponse,
             responses=ANSWER_STREAM | CONVERSATION_ANSWER | errors(400, 422))
async def regenerate(message_id: str, ctx: Ctx, conv: OwnedConversation, session: SessionDep, user: CurrentUser,
                     body: GenerationIn | None = None, idempotency_key: str | None = Header(
                         None, alias=resend.HEADER,
                         description="The sender's name for this regeneration (a UUID, say): sent again with "
                                     "the same key after a lost reply, one new answer is made and billed, and "
                                     "the repeat streams it from its start.")
                     ) -> EventStreamResponse:
    """Stream a new answer beside an assistant message (or a new answer to a user message)."""
    key, conversation_id = resend.checked_key(idempotency_key), conv.id
    return await _answer_once(
        ctx, session, conversation_id, key,
        lambda: resend.earlier_regeneration(session, conversation_id, key, message_id),
        lambda: ctx.conversations.regenerate(session, conv, message_id, _options(user, body), key),
        "this answer was started by another request at the same time")


@router.post("/{conversation_id}/stop", response_model=StopOut, responses=OWN_CONVERSATION | errors(503))
async def stop(ctx: Ctx, conv: OwnedConversation) -> StopOut:
    """Abort the running answer (on whichever gateway runs it); returns once the partial answer is saved
    as 'stopped'."""
    message_id = await _stop(ctx, conv.id)
    return StopOut(stopped=message_id is not None, message_id=message_id)


async def _stop(ctx: Ctx, conversation_id: str) -> str | None:
    return await stop_anywhere(conversation_id, ctx.conversations.stop, ctx.hot.jobs, ctx.hot.stops,
                               ctx.conversations.logs)


# -- resumable streams ---------------------------------------------------------------

def _event_id(value: str | None, where: str) -> int:
    if value is None or value == "":
        return 0
    try:
        n = int(value)
    except ValueError:
        raise ApiError(400, f"{where} must be an event id (an integer)", "invalid_value", where) from None
    if n < 0:
        raise ApiError(400, f"{where} must not be negative", "invalid_value", where)
    return n


@router.get("/{conversation_id}/stream", response_class=EventStreamResponse,
            responses=ANSWER_STREAM | OWN_CONVERSATION | errors(503))
async def resume_stream(ctx: Ctx, conv: OwnedConversation, session: SessionDep,
                        message_id: str | None = Query(None, max_length=40),
                        last_event_id: str | None = Query(None, max_length=20),
                        last_event_id_header: str | None = Header(None, alias="Last-Event-ID", max_length=20)
                        ) -> EventStreamResponse:
    """The events of the conversation's newest answer (or of ?message_id=) after Last-Event-ID
    (header, as EventSource sends it on reconnect, or ?last_event_id=): live while it runs, the
    rest and its end once it has finished. Any number of clients may attach."""
    after = _event_id(last_event_id_header if last_event_id_header is not None else last_event_id,
                      "Last-Event-ID")
    logs = ctx.conversations.logs
    if message_id is not None:  # an answer of another conversation must not open here
        row = await session.scalar(select(Message.id).where(Message.id == message_id,
                                                            Message.conversation_id == conv.id))
        key = message_id if row is not None else None
    else:
        key = await logs.pointer(conv.id)
    # A long-lived stream must not hold a database connection.
    await session.close()
    log = await logs.get(key) if key else None
    if log is None:
        raise ApiError(404, "no stream to resume: no answer of this conversation is running or recently "
                       "finished", "stream_not_found")
    return _sse(log, after, {"X-Conversation-Id": conv.id, "X-Message-Id": log.key})
