"""A user's own traffic: tokens used and what is left of the tier, and feedback on answers."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from fastapi import APIRouter, Query

from chatloom.app.api.deps import Ctx, CurrentUser, SessionDep
from chatloom.app.core.errors import ApiError, not_found
from chatloom.app.api.openapi_responses import SIGNED_IN, errors
from chatloom.app.api.traffic_schemas import FeedbackIn, FeedbackOut, MyUsage, TierLimits, UsageReport
from chatloom.app.traffic.metering import utc_day
from chatloom.store import Conversations, FeedbackRows, Message, UsageRows

router = APIRouter(tags=["usage"], responses=SIGNED_IN)


def since(days: int) -> str:
    """The first UTC day of a report over the last `days` days."""
    return utc_day((datetime.now(timezone.utc) - timedelta(days=days - 1)).timestamp())


@router.get("/usage", response_model=MyUsage, responses=errors(503))  # 503: the shared quota store (Redis) away
async def my_usage(ctx: Ctx, user: CurrentUser, session: SessionDep,
                   days: int = Query(30, ge=1, le=366)) -> MyUsage:
    """Your tokens per day and model over the last `days` days, your tier and what is left of it now."""
    traffic = ctx.traffic
    tier = traffic.tier(user)
    state = await traffic.quotas.state(user.id, tier)
    report = UsageReport.of(await UsageRows(session).query(user.id, since(days)))
    limits = TierLimits(tokens_per_minute=tier.tokens_per_minute, tokens_per_day=tier.tokens_per_day,
                        requests_per_minute=tier.requests_per_minute, max_concurrent=tier.max_concurrent,
                        max_tokens=tier.max_tokens, models=list(tier.models) if tier.models else None)
    return MyUsage(**report.model_dump(), tier=tier.name, limits=limits,
                   remaining_tokens_this_minute=max(0, state.remaining_tokens), tokens_counted_today=state.day_used)


async def _own_answer(session, user_id: str, message_id: str) -> Message:
    msg = await session.get(Message, message_id)
    conv = await Conversations(session).get_owned(user_id, msg.conversation_id) if msg is not None else None
    if msg is None or conv is None:
        raise not_found("message")
    if msg.role != "assistant":
        raise ApiError(400, "feedback is for assistant messages", "invalid_message", "message_id")
    return msg


@router.post("/messages/{message_id}/feedback", status_code=201, response_model=FeedbackOut,
             responses=errors(404))
async def feedback(message_id: str, body: FeedbackIn, user: CurrentUser, session: SessionDep) -> FeedbackOut:
    """Thumbs up or down on one of your answers; sending again replaces your earlier feedback.
    The rating shows on the message in GET /conversations/{id}."""
    msg = await _own_answer(session, user.id, message_id)
    row = await FeedbackRows(session).put(msg.id, user.id, body.rating, (body.text or "").strip() or None)
    await session.commit()
    return FeedbackOut.of(row)


@router.get("/messages/{message_id}/feedback", response_model=FeedbackOut, responses=errors(404))
async def read_feedback(message_id: str, user: CurrentUser, session: SessionDep) -> FeedbackOut:
    """Your feedback on one of your answers (404 if you gave none)."""
    msg = await _own_answer(session, user.id, message_id)
    ratings = await FeedbackRows(session).ratings(user.id, [msg.id])
    if msg.id not in ratings:
        raise not_found("feedback")
    return FeedbackOut.of(ratings[msg.id])
