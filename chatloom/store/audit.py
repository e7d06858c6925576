"""The audit log: admin actions and security events (who, what, when, from where).

Rows keep the actor's id and name as text, without a foreign key, so the record of what an account did
outlives the account."""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, DateTime, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from chatloom.store.models import Base, new_id, utcnow


class AuditEvent(Base):
    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_at", "at"), Index("ix_audit_events_actor_at", "actor_id", "at"))

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("aud"))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    action: Mapped[str] = mapped_column(String(64))  # e.g. auth.login_failed, admin.set_tier
    actor_id: Mapped[str | None] = mapped_column(String(40))  # None: nobody signed in (a failed login)
    actor_name: Mapped[str | None] = mapped_column(String(64))  # the username given or signed in
    address: Mapped[str | None] = mapped_column(String(64))  # the client's address
    target: Mapped[str | None] = mapped_column(String(200))  # what was acted on (a path, a key id, a user)
    status: Mapped[int | None] = mapped_column(Integer)  # the HTTP status answered, where known
    detail: Mapped[dict] = mapped_column(JSON, default=dict)
