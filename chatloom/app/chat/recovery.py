"""Crash recovery: an answer being written survives the process that writes it.

- Journal: every piece of answer text (and reasoning) is in the database before any client is sent it
  (state/answer_journal.py), appended per engine step to `answer_chunks`; when the answer ends its rows are
  folded into the message. Each answer also names its writer: the instance id of the process writing it.
- Sweeps: an answer still marked in progress whose writer is dead was left behind; it is marked
  `interrupted`, its journaled text folded into it, with a reason. Alone (no Redis), this process is
  the only writer, so at start every answer in progress is such an answer, and is marked before the
  first request is served. With Redis, a writer is dead once its liveness key has expired (shared_state.job_lease_s
  after its last renewal); its answers that a job lease still covers are left to the job keeper, which
  takes them over and continues them (hotstate/job_keeper.py), and the rest are marked. Answers with no
  writer (written by an older version) are judged by their heartbeat's age, `recovery.stale_s`.
- Drain: on shutdown (SIGTERM), running answers get up to `shutdown_drain_s` to finish; the rest
  are stopped and marked `interrupted` with their partial text.
- Continue: an interrupted (or stopped, or cut-off) answer resumes from its saved text: the prompt
  ends with that text as the start of the assistant's turn, and the new tokens are appended to the
  same message. Regenerating instead makes a new sibling answer as usual.
"""
from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.exc import DBAPIError

from chatloom.app.state.background import cancel_requested, stop_loop
from chatloom.app.state.redis_connection import RedisError
from chatloom.app.core.errors import ApiError, not_found
from chatloom.app.chat.branches import Tree
from chatloom.app.chat.conversation_prompt import branch_turns
from chatloom.store import AnswerChunks, Conversations, Database, Message, Messages
from chatloom.store.models import utcnow
from chatloom.store.repositories import answer_in_progress

# The conversation service and its Generation are passed in, not imported: the service imports this
# module, and rooms keep their imports one-way.
ConversationService = Any
Generation = Any

log = logging.getLogger(__name__)

CRASHED = "the server stopped while this answer was being written"
SHUT_DOWN = "the server shut down before this answer was finished"
CONTINUABLE = ("interrupted", "stopped", "incomplete")


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=timezone.utc)  # SQLite returns naive UTC


async def interrupt(db: Database, message_ids: list[str], reason: str = CRASHED) -> list[str]:
    """Mark answers still in progress as interrupted, their journaled text folded in; returns their ids."""
    if not message_ids:
        return []
    async with db.session() as session:
        ids = list(await session.scalars(select(Message.id).where(Message.id.in_(message_ids), answer_in_progress())))
        if ids:
            await AnswerChunks(session).fold(ids)
            await session.execute(update(Message).where(Message.id.in_(ids), answer_in_progress()).values(
                status="interrupted", finish_reason="interrupted", interrupted_reason=reason))
            await session.commit()
    if ids:
        log.warning("marked %d answer(s) left by a stopped process as interrupted", len(ids))
    return ids


async def mark_interrupted(db: Database, message_ids: list[str], reason: str) -> None:
    """Answers this process stopped on its way out: interrupted, not stopped by their users."""
    if not message_ids:
        return
    async with db.session() as session:
        await AnswerChunks(session).fold(message_ids)  # saved when they stopped; whatever is left, kept
        await session.execute(update(Message).where(
            Message.id.in_(message_ids), or_(Message.status.in_(("stopped", "incomplete")))).values(
            status="interrupted", finish_reason="interrupted", interrupted_reason=reason))
        await session.commit()


class Sweeper:
    """Marks answers abandoned by dead processes: at start (before the first request), then every half
    stale period. `alone`: no shared state, so this process is the only writer."""

    def __init__(self, service: ConversationService, alone: bool) -> None:
        self.service = service
        self.alone = alone
        self._task: asyncio.Task | None = None

    @property
    def period_s(self) -> float:
        """Half the stale period; with Redis at most a lease, the time a dead writer's liveness key takes to expire."""
        settings = self.service.settings
        period = settings.recovery.stale_s / 2 if self.alone else min(settings.recovery.stale_s / 2, settings.shared_state.job_lease_s)
        return max(0.5, period)

    async def abandoned(self, at_start: bool = False) -> list[str]:
        """Answers in progress whose writer is dead (see the module docstring)."""
        service = self.service
        jobs = service.jobs
        own = {g.message_id for g in service._running.values() if g is not None}
        async with service.db.session() as session:
            rows = (await session.execute(select(Message.id, Message.conversation_id, Message.writer,
                                                 Message.heartbeat, Message.created).where(answer_in_progress()))).all()
        cutoff = utcnow() - timedelta(seconds=service.settings.recovery.stale_s)
        others = {r.writer for r in rows if r.writer is not None and r.writer != jobs.instance}
        alive = await jobs.alive(others) if others else set()
        out = []
        for r in rows:
            if r.id in own:
                continue
            if r.writer is None or r.writer == jobs.instance:
                # An older version's answer, or one of this process's that is not running (a failure
                # between saving it and starting it): judged by age. Alone at start, none can be alive.
                if not (self.alone and at_start) and _aware(r.heartbeat or r.created) >= cutoff:
                    continue
            elif r.writer in alive:
                continue
            elif not self.alone:
                holder = await jobs.holder(r.conversation_id)
                if holder is not None and holder.message_id == r.id:
                    continue  # a job lease covers it: the job keeper takes it over (or ends it)
            out.append(r.id)
        return out

    async def sweep(self, at_start: bool = False) -> list[str]:
        return await interrupt(self.service.db, await self.abandoned(at_start))

    async def start(self) -> None:
        """Alone, sweep now (the database is all it needs); with Redis, from the background loop, so that a
        gateway starts while Redis is away."""
        if self.alone:
            try:
                await self.sweep(at_start=True)
            except Exception:
                log.exception("recovery sweep failed")
        self._task = asyncio.get_running_loop().create_task(self._loop(first=not self.alone), name="recovery-sweeper")

    async def _loop(self, first: bool) -> None:
        while True:
            if not first:
                await asyncio.sleep(self.period_s)
            first = False
            try:
                await self.sweep()
            except Exception as exc:
                if cancel_requested():
                    raise asyncio.CancelledError from exc
                if isinstance(exc, (RedisError, DBAPIError, OSError)):  # an outage: the next sweep retries
                    log.warning("recovery sweep skipped: %s: %s", type(exc).__name__, exc)
                else:
                    log.exception("recovery sweep failed")

    async def stop(self) -> None:
        await stop_loop(self._task)


async def drain(service: ConversationService, deadline_s: float) -> None:
    """Let running answers finish for up to `deadline_s`, then stop the rest and mark them interrupted."""
    running = [g for g in service._running.values() if g is not None]
    if running and deadline_s > 0:
        log.info("draining %d running answer(s) for up to %.0f s", len(running), deadline_s)
        await asyncio.wait([asyncio.ensure_future(g.finished.wait()) for g in running], timeout=deadline_s)
    left = [g for g in running if not g.finished.is_set()]
    left += [g for g in service._running.values() if g is not None and g not in running]  # started meanwhile
    await service.shutdown()
    await mark_interrupted(service.db, [g.message_id for g in left], SHUT_DOWN)
    if left:
        log.warning("%d answer(s) interrupted by the shutdown", len(left))


async def continue_answer(service: ConversationService, session, conv, message_id: str, options) -> Generation:
    """Resume an interrupted (or stopped, or cut-off) answer from its saved text, in the same message."""
    conversation_id = conv.id  # read now: a failed write leaves the row unreadable until a rollback
    service._claim(conv.id)
    run = None
    claimed = False
    try:
        # Across the fleet too: an "incomplete" answer may be one another gateway is still writing.
        claimed = await service._claim_fleet(conv.id)
        run = await service.pipeline.open(options.ask(""))
        target = await Messages(session).get(conv.id, message_id)
        if target is None:
            raise not_found("message")
        if target.role != "assistant" or target.status not in CONTINUABLE:
            raise ApiError(409, f"only an interrupted, stopped or cut-off answer can be continued (this one is "
                           f"{target.status})", "not_continuable")
        if not target.text:
            raise ApiError(409, "this answer has no text to continue from; regenerate it instead", "not_continuable")
        tree = Tree(await Messages(session).all_in(conv.id))
        planned = await service.reserve_answer(run, *branch_turns(tree.path_to(target.parent_id), conv.summary,
                                                                  conv.summary_upto), prefix=target.text,
                                                   session=session)
        await session.execute(update(Message).where(Message.id == target.id).values(
            status="incomplete", finish_reason=None, interrupted_reason=None, error=None, heartbeat=utcnow(),
            writer=service.jobs.instance))
        await Conversations(session).touch(conv.id, current_leaf_id=target.id)
        await session.commit()
        return await service._start(conv.id, target.parent_id, target.id, run, prefix=target.text, planned=planned)
    except BaseException:
        await service._give_back(conversation_id, claimed, run)
        raise
