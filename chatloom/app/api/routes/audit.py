"""The audit log for admins: GET /admin/audit (app/core/audit.py writes it)."""
from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Query
from pydantic import BaseModel

from chatloom.app.api.deps import AdminUser, Ctx
from chatloom.app.api.openapi_responses import ADMIN
from chatloom.app.api.schemas import iso
from chatloom.store.audit import AuditEvent

router = APIRouter(prefix="/admin", tags=["admin"], responses=ADMIN)


class AuditEventOut(BaseModel):
    id: str
    at: str | None
    action: str
    actor_id: str | None
    actor_name: str | None
    address: str | None
    target: str | None
    status: int | None
    detail: dict

    @classmethod
    def of(cls, e: AuditEvent) -> "AuditEventOut":
        return cls(id=e.id, at=iso(e.at), action=e.action, actor_id=e.actor_id, actor_name=e.actor_name,
                   address=e.address, target=e.target, status=e.status, detail=e.detail or {})


@router.get("/audit", response_model=list[AuditEventOut])
async def audit_events(_admin: AdminUser, ctx: Ctx, limit: int = Query(100, ge=1, le=1000),
                       before: datetime | None = Query(None, description="only events before this time (ISO 8601)"),
                       action: str | None = Query(None, max_length=64, description="one action, or a family "
                                                                                   "ending in '.' (auth.)"),
                       actor_id: str | None = Query(None, max_length=40)) -> list[AuditEventOut]:
    """Admin actions and security events, newest first: sign-ins (and failed and limited ones), sign-ups,
    API keys made and revoked, sessions revoked, accounts deleted, every /admin change with its status."""
    assert ctx.audit is not None
    return [AuditEventOut.of(e) for e in await ctx.audit.read(limit=limit, before=before, action=action,
                                                              actor_id=actor_id)]
