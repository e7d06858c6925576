"""Liveness, readiness, and the Prometheus metrics."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from chatloom.app.deps import Ctx, current_user, get_context, get_session, require_admin
from chatloom.app.metrics import CONTENT_TYPE
from chatloom.app.readiness import readiness

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    """The process is up (answers while the model is still loading)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(ctx: Ctx) -> JSONResponse:
    """Ready once the model is loaded and the database and Redis (if configured) answer; 503 otherwise,
    naming what is missing (see chatloom/app/readiness.py)."""
    status, body = await readiness(ctx.backend, ctx.db, ctx.hot)
    if status == 200:
        return JSONResponse(body)
    retry = "1" if body["status"] == "unavailable" else "5"
    return JSONResponse(body, status_code=status, headers={"Retry-After": retry})


async def _metrics_access(request: Request) -> None:
    """Open to all when metrics_public is set (as vLLM serves them); otherwise admins only."""
    if get_context(request).settings.metrics_public:
        return
    async for session in get_session(request):
        require_admin(await current_user(request, session))


@router.get("/metrics", dependencies=[Depends(_metrics_access)])
async def metrics(ctx: Ctx) -> Response:
    """Prometheus text format: vLLM's engine metrics (vllm:...) and the gateway's (chatloom:...),
    goodput under the configured SLO among them."""
    return Response(ctx.traffic.metrics.render(), media_type=CONTENT_TYPE)
