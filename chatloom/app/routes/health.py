"""Liveness, readiness and (for admins) engine figures."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from chatloom.app.auth import current_user
from chatloom.app.deps import get_context
from chatloom.app.errors import ApiError
from chatloom.store import User

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    """The process is up (answers while the model is still loading)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready once the model is loaded; 503 before (or if loading failed)."""
    backend = get_context(request).backend
    if backend.ready:
        return JSONResponse({"status": "ready", "models": backend.model_ids,
                             "context_window": backend.context_window})
    body = {"status": "failed", "error": backend.load_error} if backend.load_error else {"status": "loading"}
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


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
