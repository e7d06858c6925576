"""POST /v1/moderations: the configured moderator (the one that checks every message and answer here)
classifies texts, answered in OpenAI's shape. Nothing is generated, so no quota is spent; with moderation
turned off there is no moderator to ask and the route says so (404) rather than pass every text."""
from __future__ import annotations

import uuid

from fastapi import APIRouter

from chatloom.app.api.deps import Ctx, CurrentUser
from chatloom.app.api.moderation_schemas import ModerationIn, ModerationOut, ModerationResultOut
from chatloom.app.api.openapi_responses import errors
from chatloom.app.core.errors import ApiError
from chatloom.app.traffic.moderation import ModerationUnavailable

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/moderations", response_model=ModerationOut, responses=errors(401, 404, 503))
async def create_moderation(body: ModerationIn, ctx: Ctx, user: CurrentUser) -> ModerationOut:
    texts = body.texts()
    moderator = ctx.traffic.moderator
    if not moderator.enabled:
        raise ApiError(404, "moderation is turned off on this server (moderation = 'off')", "moderation_off")
    try:
        model, results = await moderator.classify(texts)
    except ModerationUnavailable as exc:
        raise ApiError(503, f"the texts could not be checked: {exc}", "moderation_unavailable",
                       headers={"Retry-After": "5"}) from None
    return ModerationOut(id=f"modr-{uuid.uuid4().hex}", model=model,
                         results=[ModerationResultOut(flagged=r.flagged, categories=r.categories,
                                                      category_scores=r.category_scores) for r in results])
