"""Batch jobs (the Batch API): a batch, and one row per line of its input file.

A batch's progress lives here, per request line, so any gateway can carry it on: the gateway running it
holds a lease (`lease_holder`, `lease_until`) that it renews while it works; once the lease lapses (or
its holder is known to be dead) another gateway claims it with one conditional UPDATE, and runs the
lines still `pending`. A line's result is written when it ends, so a takeover repeats at most the lines
that were running.
"""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import (JSON, BigInteger, DateTime, ForeignKey, Index, Integer, String, Text, UniqueConstraint, and_,
                        func, or_, select, update)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from chatloom.store.models import Base, new_id, utcnow

# OpenAI's batch statuses. A batch in one of ACTIVE has work left for some gateway.
BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
# A line: pending (to run), done (its response is in `result`), failed (its error is in `result`).
LINE_STATUSES = ("pending", "done", "failed")


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_user_created", "user_id", "created"),
                      Index("ix_batches_status", "status"))

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("batch"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="validating")
    meta: Mapped[dict | None] = mapped_column(JSON)  # the caller's metadata (up to 16 string pairs)
    errors: Mapped[list | None] = mapped_column(JSON)  # why the whole batch failed: [{"code", "message", "line"}]
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The gateway process (instance id) running the batch, and until when its claim holds.
    lease_holder: Mapped[str | None] = mapped_column(String(120))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class BatchLine(Base):
    """One request line of a batch's input: the request (None when the line was not a valid one), and once
    it ended, the line of the output or error file it gives."""

    __tablename__ = "batch_lines"
    __table_args__ = (UniqueConstraint("batch_id", "line", name="uq_batch_lines_batch_line"),
                      Index("ix_batch_lines_batch_status", "batch_id", "status"))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    line: Mapped[int] = mapped_column(Integer)  # 1-based line number in the input file
    custom_id: Mapped[str | None] = mapped_column(String(512))
    body: Mapped[dict | None] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    result: Mapped[dict | None] = mapped_column(JSON)  # the output (or error) file's object for this line
    error: Mapped[str | None] = mapped_column(Text)  # why a line failed validation (it never ran)


class Batches:
    """Queries on batches and their lines."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get_owned(self, user_id: str, batch_id: str) -> Batch | None:
        batch = await self.session.get(Batch, batch_id, populate_existing=True)
        return batch if batch is not None and batch.user_id == user_id else None

    async def page(self, user_id: str, after: str | None, limit: int) -> list[Batch]:
        """The user's batches, newest first, after the batch `after` (ids sort by creation time)."""
        query = select(Batch).where(Batch.user_id == user_id)
        if after:
            query = query.where(Batch.id < after)
        return list(await self.session.scalars(query.order_by(Batch.id.desc()).limit(limit)))

    async def active(self, limit: int = 100) -> list[Batch]:
        """Batches with work left for some gateway, oldest first."""
        query = select(Batch).where(Batch.status.in_(ACTIVE)).order_by(Batch.id).limit(limit)
        return list(await self.session.scalars(query))

    async def claim(self, batch_id: str, holder: str, until: datetime, now: datetime,
                    take_from: str | None = None) -> bool:
        """Hold the batch until `until` if it is free, already ours, lapsed, or held by `take_from` (a holder
        known to be dead); one UPDATE, so two gateways never both win."""
        free = or_(Batch.lease_holder.is_(None), Batch.lease_holder == holder, Batch.lease_until < now)
        if take_from is not None:
            free = or_(free, Batch.lease_holder == take_from)
        result = await self.session.execute(
            update(Batch).where(and_(Batch.id == batch_id, Batch.status.in_(ACTIVE), free))
            .values(lease_holder=holder, lease_until=until).execution_options(synchronize_session=False))
        await self.session.commit()
        return result.rowcount == 1

    async def renew(self, batch_id: str, holder: str, until: datetime) -> bool:
        """Extend our lease; False when another gateway holds the batch now."""
        result = await self.session.execute(
            update(Batch).where(and_(Batch.id == batch_id, Batch.lease_holder == holder))
            .values(lease_until=until).execution_options(synchronize_session=False))
        await self.session.commit()
        return result.rowcount == 1

    async def release(self, batch_id: str, holder: str) -> None:
        """Let the batch go now (this gateway stops): another may claim it at once."""
        await self.session.execute(
            update(Batch).where(and_(Batch.id == batch_id, Batch.lease_holder == holder))
            .values(lease_holder=None, lease_until=None).execution_options(synchronize_session=False))
        await self.session.commit()

    async def pending_lines(self, batch_id: str, limit: int | None = None) -> list[BatchLine]:
        query = select(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.status == "pending")
        return list(await self.session.scalars(query.order_by(BatchLine.line).limit(limit)))

    async def ended_lines(self, batch_id: str, status: str, after: int, limit: int) -> list[BatchLine]:
        query = select(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.status == status,
                                        BatchLine.line > after)
        return list(await self.session.scalars(query.order_by(BatchLine.line).limit(limit)))

    async def counts(self, batch_id: str) -> dict[str, int]:
        rows = await self.session.execute(select(BatchLine.status, func.count()).where(BatchLine.batch_id == batch_id)
                                          .group_by(BatchLine.status))
        return {status: n for status, n in rows}
