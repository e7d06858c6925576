"""Crash recovery: an answer being written survives the process that writes it.

- Checkpoints: while an answer streams, a reader of its event log (like any SSE client) saves the
  text so far to the database every `checkpoint_interval_s` (not per token), with a heartbeat time.
- Sweeps: an answer still marked in progress whose heartbeat is older than `recovery_stale_s` was
  left by a dead process (this one before a restart, or another gateway). At start and then
  periodically it is marked `interrupted`, keeping the saved text and a reason.
- Drain: on shutdown (SIGTERM), running answers get up to `shutdown_drain_s` to finish; the rest
  are stopped and marked `interrupted` with their partial text.
- Continue: an interrupted (or stopped, or cut-off) answer resumes from its saved text: the prompt
  ends with that text as the start of the assistant's turn, and the new tokens are appended to the
  same message. Regenerating instead makes a new sibling answer as usual.
"""
from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update

from chatloom.app.state.background import cancel_requested, stop_loop
from chatloom.app.core.errors import ApiError, not_found
from chatloom.app.chat.branches import Tree
from chatloom.store import Conversations, Database, Message, Messages
from chatloom.store.models import utcnow

# The conversation service and its Generation are passed in, not imported: the service imports this
# module (to start checkpoints), and rooms keep their imports one-way.
ConversationService = Any
Generation = Any

log = logging.getLogger(__name__)

CRASHED = "the server stopped while this answer was being written"
SHUT_DOWN = "the server shut down before this answer was finished"
CONTINUABLE = ("interrupted", "stopped", "incomplete")

_tasks: set[asyncio.Task] = set()  # strong references to the checkpoint tasks while they run


def _in_progress():
    """Answers still being written: incomplete with no outcome yet."""
    return and_(Message.role == "assistant", Message.status == "incomplete", Message.finish_reason.is_(None))


async def save_checkpoint(db: Database, message_id: str, text: str, tokens: int) -> bool:
    """Save the text so far and a fresh heartbeat, unless the answer has ended meanwhile."""
    async with db.session() as session:
        result = await session.execute(update(Message).where(Message.id == message_id, _in_progress())
                                       .values(text=text, tokens=tokens, heartbeat=utcnow()))
        await session.commit()
        return result.rowcount > 0


def start_checkpointer(service: ConversationService, gen: Generation) -> asyncio.Task:
    """Save `gen`'s answer text every checkpoint interval while it runs."""
    task = asyncio.get_running_loop().create_task(_checkpoint(service, gen), name=f"checkpoint-{gen.message_id}")
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


async def _checkpoint(service: ConversationService, gen: Generation) -> None:
    interval = service.settings.checkpoint_interval_s
    parts: list[str] = []
    saved = -1  # characters of text saved so far (-1: nothing, not even the heartbeat)
    last = time.monotonic()
    try:
        async for ev in gen.log.read(0, heartbeat_s=interval):
            if ev is not None:
                token = ev.data.get("token")
                if token:
                    parts.append(token)
                if ev.data.get("done") or ev.event == "error":
                    return  # the generation saves its own outcome
            now = time.monotonic()
            if now - last >= interval or ev is None:
                last = now
                text = "".join(parts)
                # Tokens of the text: prompt assembly uses them if the answer ends up interrupted.
                tokens = service._count(text) if len(text) != saved else None
                if tokens is not None or ev is None:
                    await save_checkpoint(service.db, gen.message_id, text,
                                          tokens if tokens is not None else service._count(text))
                    saved = len(text)
    except asyncio.CancelledError:
        raise
    except Exception:  # a failed save must not fail the answer; the final save still comes
        log.exception("checkpoint of %s failed", gen.message_id)


async def interrupt_stale(db: Database, stale_s: float, exclude: set[str] | None = None,
                          reason: str = CRASHED) -> list[str]:
    """Mark answers whose writer stopped beating `stale_s` ago as interrupted; returns their ids."""
    cutoff = utcnow() - timedelta(seconds=stale_s)
    async with db.session() as session:
        ids = list(await session.scalars(select(Message.id).where(
            _in_progress(), func.coalesce(Message.heartbeat, Message.created) < cutoff)))
        ids = [i for i in ids if i not in (exclude or set())]
        if ids:
            await session.execute(update(Message).where(Message.id.in_(ids), _in_progress()).values(
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
        await session.execute(update(Message).where(
            Message.id.in_(message_ids), or_(Message.status.in_(("stopped", "incomplete")))).values(
            status="interrupted", finish_reason="interrupted", interrupted_reason=reason))
        await session.commit()


class Sweeper:
    """Marks answers abandoned by dead processes, at start and every half stale period after."""

    def __init__(self, service: ConversationService) -> None:
        self.service = service
        self._task: asyncio.Task | None = None

    async def sweep(self) -> list[str]:
        own = {g.message_id for g in self.service._running.values() if g is not None}
        return await interrupt_stale(self.service.db, self.service.settings.recovery_stale_s, own)

    async def start(self) -> None:
        try:
            await self.sweep()
        except Exception:
            log.exception("recovery sweep failed")
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="recovery-sweeper")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, self.service.settings.recovery_stale_s / 2))
            try:
                await self.sweep()
            except Exception as exc:
                if cancel_requested():
                    raise asyncio.CancelledError from exc
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
    service._claim(conv.id)
    run = None
    try:
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
        turns = [m.tokens for m in tree.path_to(target.parent_id)] + [target.tokens]
        await run.reserve(service.prompts.estimate(turns, run.max_tokens))
        await session.execute(update(Message).where(Message.id == target.id).values(
            status="incomplete", finish_reason=None, interrupted_reason=None, error=None, heartbeat=utcnow()))
        await Conversations(session).touch(conv.id, current_leaf_id=target.id)
        await session.commit()
        return await service._start(conv.id, target.parent_id, target.id, run, prefix=target.text)
    except BaseException:
        service._unclaim(conv.id)
        if run is not None:
            await run.close()
        raise
