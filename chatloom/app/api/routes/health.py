"""Liveness, readiness, and the Prometheus metrics."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from chatloom.app.api.deps import Ctx, current_user, get_context, get_session, require_admin
from chatloom.app.api.openapi_responses import ADMIN, RETRY_AFTER, PrometheusText
from chatloom.app.api.readiness import readiness

router = APIRouter(tags=["health"])


class HealthOut(BaseModel):
    status: Literal["ok"]


class ReadinessOut(BaseModel):
    """What /readyz answers (chatloom/app/api/readiness.py): the models and window once ready; otherwise
    what is missing. `checks` has one entry per dependency (backend, database, redis)."""

    status: Literal["ready", "loading", "failed", "unavailable"]
    models: list[str] | None = None
    context_window: int | None = None
    error: str | None = None
    checks: dict[str, dict] | None = None


@router.get("/healthz", response_model=HealthOut)
async def healthz() -> dict:
    """The process is up (answers while the model is still loading)."""
    return {"status": "ok"}


@router.get("/readyz", response_model=ReadinessOut,
            responses={503: {"model": ReadinessOut, "headers": RETRY_AFTER,
                             "description": "Not ready: the model is loading or failed, or the database or "
                                            "Redis is out of reach (the body says which)."}})
async def readyz(ctx: Ctx) -> JSONResponse:
    """Ready once the model is loaded and the database and Redis (if configured) answer; 503 otherwise,
    naming what is missing (see chatloom/app/api/readiness.py)."""
    status, body = await readiness(ctx.backend, ctx.db, ctx.hot)
    if status == 200:
        return JSONResponse(body)
    retry = "1" if body["status"] == "unavailable" else "5"
    return JSONResponse(body, status_code=status, headers={"Retry-After": retry})


async def _metrics_access(request: Request) -> None:
    """Open to all when metrics_public is set (as vLLM serves them); otherwise admins only."""
    if get_context(request).settings.server.metrics_public:
        return
    async for session in get_session(request):
        await require_admin(await current_user(request, session))


@router.get("/metrics", dependencies=[Depends(_metrics_access)], response_class=PrometheusText,
            responses=ADMIN)  # 401/403 only when metrics_public is off
async def metrics(ctx: Ctx) -> PrometheusText:
    """Prometheus text format: vLLM's engine metrics (vllm:...) and the gateway's (chatloom:...),
    goodput under the configured SLO among them. Admins only when metrics_public is off."""
    return PrometheusText(ctx.traffic.metrics.render())
