"""Traffic routes: resumable streams, usage, feedback, tiers and reasoning caps (admin), /metrics."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.auth import current_user
from chatloom.app.deps import get_context, get_session
from chatloom.app.errors import ApiError, not_found
from chatloom.app.metrics import CONTENT_TYPE
from chatloom.app.reasoning import EFFORTS
from chatloom.app.routes.conversations import HEARTBEAT_S, owned_conversation
from chatloom.app.schemas import iso
from chatloom.app.sse import HEARTBEAT, SSE_HEADERS, frame_event
from chatloom.app.traffic import Traffic
from chatloom.app.usage import usage_out, utc_day
from chatloom.store import Conversation, Conversations, FeedbackRows, Message, UsageRows, User, Users

router = APIRouter(tags=["traffic"])

STRICT = ConfigDict(extra="forbid", strict=True)


def get_traffic(request: Request) -> Traffic:
    return get_context(request).traffic


def require_admin(user: User = Depends(current_user)) -> User:
    if not user.is_admin:
        raise ApiError(403, "admins only", "forbidden")
    return user


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


@router.get("/conversations/{conversation_id}/stream")
async def resume_stream(request: Request, conv: Conversation = Depends(owned_conversation),
                        message_id: str | None = Query(None, max_length=40),
                        last_event_id: str | None = Query(None, max_length=20),
                        last_event_id_header: str | None = Header(None, alias="Last-Event-ID", max_length=20)
                        ) -> StreamingResponse:
    """The events of the conversation's newest answer (or of ?message_id=) after Last-Event-ID
    (header, as EventSource sends it on reconnect, or ?last_event_id=): live while it runs, the
    rest and its end once it has finished. Any number of clients may attach."""
    after = _event_id(last_event_id_header if last_event_id_header is not None else last_event_id,
                      "Last-Event-ID")
    logs = get_context(request).conversations.logs
    if message_id is not None:  # an answer of another conversation must not open here
        key = message_id if await _message_in(request, conv.id, message_id) else None
    else:
        key = await logs.pointer(conv.id)
    log = await logs.get(key) if key else None
    if log is None:
        raise ApiError(404, "no stream to resume: no answer of this conversation is running or recently "
                       "finished", "stream_not_found")

    async def events():
        async for ev in log.read(after, heartbeat_s=HEARTBEAT_S):
            yield HEARTBEAT if ev is None else frame_event(ev)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={**SSE_HEADERS, "X-Conversation-Id": conv.id, "X-Message-Id": log.key})


async def _message_in(request: Request, conversation_id: str, message_id: str) -> bool:
    async with get_context(request).db.session() as session:
        row = await session.scalar(select(Message.id).where(Message.id == message_id,
                                                            Message.conversation_id == conversation_id))
    return row is not None


# -- usage and feedback ------------------------------------------------------------------

def _since(days: int) -> str:
    return utc_day((datetime.now(timezone.utc) - timedelta(days=days - 1)).timestamp())


@router.get("/usage")
async def my_usage(days: int = Query(30, ge=1, le=366), user: User = Depends(current_user),
                   session: AsyncSession = Depends(get_session), traffic: Traffic = Depends(get_traffic)) -> dict:
    """Your tokens per day and model over the last `days` days, your tier and what is left of it now."""
    tier = traffic.tier(user)
    state = await traffic.quotas.state(user.id, tier)
    out = usage_out(await UsageRows(session).query(user.id, _since(days)))
    for item in out["data"]:
        item.pop("username")
    return {**out, "tier": tier.name,
            "limits": {"tokens_per_minute": tier.tokens_per_minute, "tokens_per_day": tier.tokens_per_day,
                       "requests_per_minute": tier.requests_per_minute, "max_concurrent": tier.max_concurrent,
                       "max_tokens": tier.max_tokens, "models": list(tier.models) if tier.models else None},
            "remaining_tokens_this_minute": max(0, state.remaining_tokens)}


@router.get("/admin/usage")
async def all_usage(days: int = Query(30, ge=1, le=366), username: str | None = Query(None, max_length=64),
                    _admin: User = Depends(require_admin), session: AsyncSession = Depends(get_session)) -> dict:
    """Everyone's tokens per user, day and model (or one user's with ?username=)."""
    user_id = None
    if username is not None:
        user = await Users(session).by_username(username)
        if user is None:
            raise not_found("user")
        user_id = user.id
    return usage_out(await UsageRows(session).query(user_id, _since(days)))


class FeedbackIn(BaseModel):
    model_config = STRICT
    rating: Literal["up", "down"]
    text: str | None = Field(default=None, max_length=4000)


@router.post("/messages/{message_id}/feedback", status_code=201)
async def feedback(message_id: str, body: FeedbackIn, user: User = Depends(current_user),
                   session: AsyncSession = Depends(get_session)) -> dict:
    """Thumbs up or down on one of your answers; sending again replaces your earlier feedback."""
    msg = await session.get(Message, message_id)
    conv = await Conversations(session).get_owned(user.id, msg.conversation_id) if msg is not None else None
    if msg is None or conv is None:
        raise not_found("message")
    if msg.role != "assistant":
        raise ApiError(400, "feedback is for assistant messages", "invalid_message", "message_id")
    row = await FeedbackRows(session).put(msg.id, user.id, body.rating, (body.text or "").strip() or None)
    await session.commit()
    return {"id": row.id, "message_id": msg.id, "rating": row.rating, "text": row.text, "created": iso(row.created)}


# -- tiers and reasoning (admin) ------------------------------------------------------------

class TierIn(BaseModel):
    model_config = STRICT
    tier: str = Field(min_length=1, max_length=32)


@router.put("/admin/users/{username}/tier")
async def set_tier(username: str, body: TierIn, _admin: User = Depends(require_admin),
                   session: AsyncSession = Depends(get_session), traffic: Traffic = Depends(get_traffic)) -> dict:
    if body.tier not in traffic.tiers:
        raise ApiError(400, f"unknown tier {body.tier!r}; configured: {', '.join(traffic.tiers.names())}",
                       "invalid_value", "tier")
    user = await Users(session).set_tier(username, body.tier)
    if user is None:
        raise not_found("user")
    await session.commit()
    return {"username": user.username, "tier": user.tier}


@router.get("/admin/tiers")
async def list_tiers(_admin: User = Depends(require_admin), traffic: Traffic = Depends(get_traffic)) -> dict:
    return {"default": traffic.tiers.default,
            "tiers": [{**t.__dict__, "models": list(t.models) if t.models else None}
                      for t in (traffic.tiers[n] for n in traffic.tiers.names())]}


class ReasoningIn(BaseModel):
    model_config = STRICT
    max_effort: Literal["low", "medium", "high"]


@router.get("/admin/reasoning")
async def get_reasoning(_admin: User = Depends(require_admin), traffic: Traffic = Depends(get_traffic)) -> dict:
    a = traffic.admission
    return {"max_effort": traffic.reasoning_max_effort, "efforts": list(EFFORTS),
            "running": a.running_of("reasoning"), "slots": a.reasoning_slots()}


@router.put("/admin/reasoning")
async def cap_reasoning(body: ReasoningIn, _admin: User = Depends(require_admin),
                        traffic: Traffic = Depends(get_traffic)) -> dict:
    """Cap the effort dial (e.g. to 'low' under load); requests asking for more get the cap."""
    traffic.reasoning_max_effort = body.max_effort
    return {"max_effort": traffic.reasoning_max_effort}


# -- metrics ----------------------------------------------------------------------------------

async def _metrics_access(request: Request, session: AsyncSession = Depends(get_session)) -> None:
    if not get_context(request).settings.metrics_public:
        user = await current_user(request, session)
        if not user.is_admin:
            raise ApiError(403, "admins only", "forbidden")


@router.get("/metrics", dependencies=[Depends(_metrics_access)])
async def metrics(traffic: Traffic = Depends(get_traffic)) -> Response:
    """Prometheus text format: vLLM's engine metrics (vllm:...) and the gateway's (chatloom:...)."""
    return Response(traffic.metrics.render(), media_type=CONTENT_TYPE)
