"""Administration: everyone's usage and feedback, tiers, the reasoning cap, engine and queue figures,
and the Operations page's snapshot."""
from __future__ import annotations

from fastapi import APIRouter, Query

from chatloom.app.api.deps import AdminUser, Ctx, SessionDep
from chatloom.app.core.errors import ApiError, not_found
from chatloom.app.api.openapi_responses import ADMIN, errors
from chatloom.app.api.ops_schemas import OpsSnapshot, snapshot
from chatloom.app.traffic.admission import REASONING
from chatloom.app.traffic.metering import utc_day
from chatloom.app.traffic.reasoning import EFFORTS
from chatloom.app.api.routes.usage import since
from chatloom.app.core.validation import Offset
from chatloom.app.api.traffic_schemas import (AdmissionOut, FeedbackItem, ReasoningCap, ReasoningIn,
                                          ReasoningOut, StatsOut, TierIn, TierOut, TiersOut, UsageReport, UserTierOut)
from chatloom.store import FeedbackRows, UsageRows, Users

router = APIRouter(prefix="/admin", tags=["admin"], responses=ADMIN)


@router.get("/usage", response_model=UsageReport, responses=errors(404))
async def all_usage(_admin: AdminUser, session: SessionDep, days: int = Query(30, ge=1, le=366),
                    username: str | None = Query(None, max_length=64)) -> UsageReport:
    """Everyone's tokens per user, day and model (or one user's with ?username=)."""
    user_id = None
    if username is not None:
        user = await Users(session).by_username(username)
        if user is None:
            raise not_found("user")
        user_id = user.id
    return UsageReport.of(await UsageRows(session).query(user_id, since(days)))


@router.get("/feedback", response_model=list[FeedbackItem])
async def list_feedback(_admin: AdminUser, session: SessionDep, rating: str | None = Query(None, pattern="^(up|down)$"),
                        limit: int = Query(50, ge=1, le=500), offset: Offset = 0) -> list[FeedbackItem]:
    """Everyone's thumbs, newest first (?rating=down for the complaints), with the rated answer."""
    return [FeedbackItem.row(f, name, m) for f, name, m in await FeedbackRows(session).page(limit, offset, rating)]


@router.put("/users/{username}/tier", response_model=UserTierOut, responses=errors(404))
async def set_tier(username: str, body: TierIn, _admin: AdminUser, ctx: Ctx, session: SessionDep) -> UserTierOut:
    tiers = ctx.traffic.tiers
    if body.tier not in tiers:
        raise ApiError(400, f"unknown tier {body.tier!r}; configured: {', '.join(tiers.names())}",
                       "invalid_value", "tier")
    user = await Users(session).set_tier(username, body.tier)
    if user is None:
        raise not_found("user")
    await session.commit()
    ctx.callers.forget_user(user.id)  # the new tier applies from the next request
    return UserTierOut(username=user.username, tier=user.tier)


@router.get("/tiers", response_model=TiersOut)
async def list_tiers(_admin: AdminUser, ctx: Ctx) -> TiersOut:
    tiers = ctx.traffic.tiers
    return TiersOut(default=tiers.default, tiers=[TierOut.of(tiers[n]) for n in tiers.names()])


@router.get("/reasoning", response_model=ReasoningOut)
async def get_reasoning(_admin: AdminUser, ctx: Ctx) -> ReasoningOut:
    a = ctx.traffic.admission
    return ReasoningOut(max_effort=ctx.traffic.reasoning_max_effort, efforts=list(EFFORTS),
                        running=a.running_of(REASONING), slots=a.reasoning_slots())


@router.put("/reasoning", response_model=ReasoningCap)
async def cap_reasoning(body: ReasoningIn, _admin: AdminUser, ctx: Ctx) -> ReasoningCap:
    """Cap the effort dial (e.g. to 'low' under load); requests asking for more get the cap."""
    ctx.traffic.reasoning_max_effort = body.max_effort
    return ReasoningCap(max_effort=ctx.traffic.reasoning_max_effort)


@router.get("/stats", response_model=StatsOut)
async def stats(_admin: AdminUser, ctx: Ctx) -> StatsOut:
    """The backend's load, the answers running, the admission queue."""
    return StatsOut(backend=ctx.backend.stats(),
                    running_generations=ctx.conversations.running_count(),
                    admission=AdmissionOut.of(ctx.traffic.admission))


@router.get("/ops", response_model=OpsSnapshot)
async def ops(_admin: AdminUser, ctx: Ctx, session: SessionDep) -> OpsSnapshot:
    """The load now, for the Operations page: replicas, the admission queue, KV occupancy, goodput per
    class, the degrade ladder, the autoscaler, and today's usage per tier."""
    day = utc_day()
    return snapshot(ctx, day, await UsageRows(session).by_tier(day))
