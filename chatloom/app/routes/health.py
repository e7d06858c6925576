"""Liveness, readiness and (for admins) engine figures."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from chatloom.app.auth import current_user
from chatloom.app.deps import get_context
from chatloom.app.errors import ApiError
from chatloom.app.readiness import readiness
from chatloom.store import User

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    """The process is up (answers while the model is still loading)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready once the model is loaded and the database and Redis (if configured) answer; 503 otherwise,
    naming what is missing (see chatloom/app/readiness.py)."""
    ctx = get_context(request)
    status, body = await readiness(ctx.backend, ctx.db, getattr(request.app.state, "hot", None))
    if status == 200:
        return JSONResponse(body)
    retry = "1" if body["status"] == "unavailable" else "5"
    return JSONResponse(body, status_code=status, headers={"Retry-After": retry})


@router.get("/admin/stats")
async def stats(request: Request, user: User = Depends(current_user)) -> dict:
    if not user.is_admin:
        raise ApiError(403, "admins only", "forbidden")
    ctx = get_context(request)
    out = {"backend": ctx.backend.stats(), "running_generations": ctx.conversations.running_count()}
    if ctx.traffic is not None:
        a = ctx.traffic.admission
        out["admission"] = {"waiting": a.waiting, "running": a.running, "max_running": a.max_running,
                            "reasoning_running": a.running_of("reasoning"), "reasoning_slots": a.reasoning_slots()}
    return out
