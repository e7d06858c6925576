"""Writing and reading the audit log (store/audit.py): admin actions and security events.

Each event is written in a session of its own and committed at once, so an event is kept even when the
request that caused it fails or rolls back, and writing one never holds up the caller's transaction."""
from __future__ import annotations

import logging
from datetime import datetime
from typing import Callable

from fastapi import Request
from sqlalchemy import select

from chatloom.app.core.log_redaction import redact
from chatloom.store import Database
from chatloom.store.audit import AuditEvent

log = logging.getLogger(__name__)

DETAIL_MAX_CHARS = 1_000


def client_address(request: Request) -> str | None:
    """The peer's address as the server sees it (behind a proxy: the proxy's, unless the server is told
    to trust its forwarding headers, as uvicorn's --forwarded-allow-ips does)."""
    return request.client.host if request.client else None


class AuditLog:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def record(self, action: str, *, request: Request | None = None, actor_id: str | None = None,
                     actor_name: str | None = None, target: str | None = None, status: int | None = None,
                     detail: dict | None = None, address: str | None = None) -> None:
        """Keep one event. A database that cannot take it is logged, not raised: the audit log must not
        turn a refused login into a 500."""
        event = AuditEvent(action=action, actor_id=actor_id, actor_name=(actor_name or None) and actor_name[:64],
                           address=client_address(request) if request is not None else address,
                           target=target[:200] if target else None, status=status, detail=_bounded(detail or {}))
        try:
            async with self.db.session() as session:
                session.add(event)
                await session.commit()
        except Exception:  # noqa: BLE001 - any database failure
            log.exception("could not write the audit event %s", action)

    async def read(self, *, limit: int = 100, before: datetime | None = None, action: str | None = None,
                   actor_id: str | None = None) -> list[AuditEvent]:
        """Newest first."""
        query = select(AuditEvent).order_by(AuditEvent.at.desc(), AuditEvent.id.desc()).limit(limit)
        if before is not None:
            query = query.where(AuditEvent.at < before)
        if action:
            query = query.where(AuditEvent.action.startswith(action) if action.endswith(".") else
                                AuditEvent.action == action)
        if actor_id:
            query = query.where(AuditEvent.actor_id == actor_id)
        async with self.db.session() as session:
            return list(await session.scalars(query))


def _bounded(detail: dict) -> dict:
    """Values cut to DETAIL_MAX_CHARS each, so one request cannot fill the log."""
    return {str(k)[:64]: (v[:DETAIL_MAX_CHARS] if isinstance(v, str) else v) for k, v in list(detail.items())[:20]}


class AdminActions:
    """ASGI middleware: every /admin request that changes something (not GET or HEAD) goes to the audit
    log once answered: who (the caller the route authenticated), what (method, path, JSON body), when, from
    where, and the status it got, refusals included."""

    BODY_MAX = 2_000

    def __init__(self, app, audit: Callable[[], "AuditLog | None"]) -> None:
        self.app = app
        self.audit = audit

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == "/admin" or path.startswith("/admin/")) or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        status: list[int] = []

        async def reading():
            message = await receive()
            if message["type"] == "http.request" and len(body) < self.BODY_MAX:
                body.extend(message.get("body", b"")[: self.BODY_MAX - len(body)])
            return message

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, reading, sending)
        finally:
            audit = self.audit()
            if audit is not None:
                user = scope.get("state", {}).get("user")
                client = scope.get("client")
                await audit.record(
                    "admin." + scope["method"].lower(), actor_id=getattr(user, "id", None),
                    actor_name=getattr(user, "username", None), target=path, status=status[0] if status else None,
                    detail={"body": redact(body.decode("utf-8", "replace"))} if body else {},
                    address=client[0] if client else None)
