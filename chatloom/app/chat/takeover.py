"""Continuing an answer another process began: the prompt plus the text produced so far is the new prompt.

When a gateway dies mid-answer, the answer's event log still holds every piece of text its
readers were sent. The gateway that takes the job over renders the same chat prompt with that
text as the start of the assistant's turn (ChatPrompt(continue_final=True), as /continue does),
and lets the model go on from there; the new pieces are appended to the same log, so a client
resuming with Last-Event-ID sees one contiguous answer. This is the router's continuation for a dead replica, done with the logged
text instead of token ids (a gateway logs text).

`TakeOver` is the conversation service's part of it: `resume_job` continues a taken-over answer,
and `_another_writer` decides what an answer does when someone else has written to its log.
"""
from __future__ import annotations

import asyncio
import logging

from chatloom.app.chat.answer_job import Generation, Outcome
from chatloom.app.generation.pipeline import Ask, Pipeline
from chatloom.app.state.answer_journal import AnswerJournal, JournaledLog
from chatloom.app.state.events import EventLogStore, logged_text
from chatloom.app.state.job_keeper import reservation_of
from chatloom.app.state.jobs import JobRecord, Jobs
from chatloom.serving import Backend, Usage
from chatloom.store import AnswerChunks, Database, Message, Messages, Users

log = logging.getLogger(__name__)


def can_continue(backend: Backend) -> bool:
    """A backend with a local tokenizer renders chat prompts itself, so it can continue an assistant turn."""
    try:
        return backend.tokenizer is not None
    except Exception:
        return False


def logged_answer_tokens(events: list) -> int | None:
    """The answer tokens its writer had made by its last logged piece (None: no piece carries a count)."""
    for e in reversed(events):
        if getattr(e, "answer_tokens", None) is not None:
            return e.answer_tokens
    return None


class TakeOver:
    """Continuing the answer of a gateway that died (a mixin of ConversationService)."""

    # Set up by ConversationService.__init__.
    db: Database
    backend: Backend
    logs: EventLogStore
    pipeline: Pipeline
    jobs: Jobs
    journal: AnswerJournal
    _running: dict[str, Generation | None]

    async def resume_job(self, record: JobRecord) -> bool:
        """Continue a taken-over answer from the text its log holds; False when it cannot be continued."""
        spec = record.spec
        if spec.get("effort") or not can_continue(self.backend):
            log.warning("answer %s cannot be continued here: %s", record.message_id,
                        "its hidden thinking is not logged" if spec.get("effort") else "the backend renders its own prompts")
            return False
        reopen = getattr(self.logs, "open_for_writing", None)
        event_log = await reopen(record.message_id) if reopen is not None else None
        if event_log is None:
            log.warning("answer %s cannot be continued: its event log is closed or gone", record.message_id)
            return False
        async with self.db.session() as session:
            message = await session.get(Message, record.message_id)
            user = await Users(session).get(spec["user_id"])
        ended = message is not None and (message.status != "incomplete" or message.finish_reason is not None)
        if message is None or ended or user is None:
            log.warning("answer %s is not continued: %s", record.message_id, "it was deleted" if message is None
                        else f"it has ended ({message.status})" if ended else "its user is gone")
            return False
        events = await self.logs.events(record.message_id)
        prefix = logged_text(events)
        used = logged_answer_tokens(events)
        if used is None:  # logged by a gateway that did not count: the prefix's own tokens
            used = self._count(prefix)
        remaining = spec["max_tokens"] - used
        run = await self.pipeline.open(Ask(user=user, model=spec["model"], max_tokens=max(1, remaining),
                                           temperature=spec["temperature"], top_p=spec.get("top_p"),
                                           request_id=f"{record.message_id}-cont", param="text"))
        reservation = reservation_of(spec)
        if reservation is not None:
            run.adopt(reservation)
        run.charge(Usage(completion_tokens=used))  # its gateway made them but never settled nor metered them
        async with self.db.session() as session:
            # The answer is this process's now, and its text is what its readers were sent: the logged text
            # (the journal may hold one more batch its dead writer committed but never published). Claimed
            # only while it is in progress: its first gateway, alive after all, may have saved it meanwhile,
            # and from here on that gateway's save finds another writer and writes nothing (final_save.py).
            if not await Messages(session).claim(record.message_id, self.jobs.instance, text=prefix,
                                                 tokens=self._count(prefix)):
                log.warning("answer %s is not continued: it ended meanwhile", record.message_id)
                return False
            await AnswerChunks(session).clear([record.message_id])
            await session.commit()
        gen = Generation(record.conversation_id, spec["user_message_id"], record.message_id, run,
                         JournaledLog(event_log, self.journal, record.message_id, used),
                         prefix=prefix, prefix_logged=True, tokens_before=used)
        self._running[record.conversation_id] = gen
        if remaining <= 0:  # it had used its whole budget: it ends as its own gateway would have ended it
            gen.task = asyncio.create_task(self._finish(gen, Outcome(answer=[prefix], finish_reason="length")),
                                           name=f"continuation-{record.message_id}")
            return True
        gen.task = asyncio.create_task(self._run(gen), name=f"continuation-{record.message_id}")
        return True

    async def _another_writer(self, gen: Generation, out: Outcome) -> None:
        """Someone else appended to this answer's log. If another gateway holds the job now, it took the
        answer over: end here unsaved. If this one still does, the other was a writer that had lost the job
        (a gateway that froze, then woke): the log no longer holds the text being continued, so the answer
        ends here as failed, with the text its readers were shown, rather than leave them waiting."""
        gen.run.stop()
        holder = await self.jobs.holder(gen.conversation_id)
        event_log = await self.logs.open_for_writing(gen.message_id) \
            if holder is not None and holder.gateway == self.jobs.gateway else None
        if event_log is None:
            gen.abandoned = True
            return
        log.warning("answer %s: a gateway that had lost it wrote to its log; it ends here", gen.message_id)
        gen.log = JournaledLog(event_log, self.journal, gen.message_id)
        out.answer = [logged_text(await self.logs.events(gen.message_id))]
        out.error = RuntimeError("a gateway that had lost this answer wrote to it after it was taken over")
