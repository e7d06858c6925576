"""Conversations: save the user's message, then run the answer as a background job.

A generation is a job, not a connection: it writes its events to an event log and saves the
answer when it ends, whether or not any client is still reading. One generation runs per
conversation at a time (across gateways: `jobs`); POST .../stop aborts it and the partial answer is
kept as 'stopped'. A gateway that dies mid-answer has its answers taken over by another gateway and
continued from their logged text (`resume_job`, see hotstate/job_keeper.py and continuation.py).

The generation's trip (caps, moderation, quota, admission, stream, output guard, settlement) is the
shared `Pipeline`; this service adds what is particular to conversations: the message tree, prompt
assembly with summaries (conversation_prompt.py), the event log and the saved answer.

With chat tools on (settings.chat_tools), an answer may call them: when a round of generation ends
in tool calls, the loop pauses, runs each call (app/tools), logs `tool_call` and `tool_result`
events, appends the calls and results to the prompt and resumes the same run, whose new prompt
starts with the previous one token for token, so the prefix cache makes resumption cheap. At most
settings.max_tool_calls_per_answer calls run per answer; after that the model must answer in text.
"""
from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field, replace

from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.chat.branches import Tree
from chatloom.app.chat.takeover import can_continue, logged_answer_tokens, logged_text
from chatloom.app.chat.conversation_prompt import ConversationDeleted, PromptAssembler, SummaryAborted
from chatloom.app.core.errors import ApiError, error_event, not_found
from chatloom.app.state.events import EventLog, EventLogStore
from chatloom.app.state.job_keeper import reservation_of, reservation_spec
from chatloom.app.state.jobs import JobRecord, Jobs, MemoryJobs
from chatloom.app.state.redis_events import LogTakenOver
from chatloom.app.generation.pipeline import (AnswerText, Ask, ChatPrompt, Finished, GenerationStopped, Pipeline, Run, Thinking,
                                   ToolCall)
from chatloom.app.chat.recovery import start_checkpointer
from chatloom.app.core.settings import Settings
from chatloom.app.chat.summary_admission import admitted_summary
from chatloom.app.generation.tool_calls import ToolUse, render_messages
from chatloom.app.chat.tools.builtins import builtin_registry
from chatloom.app.chat.tools.registry import ToolContext, ToolRegistry
from chatloom.app.core.validation import off_loop
from chatloom.serving import BackendError, BadGenerationRequest, Usage
from chatloom.store import Conversation, Conversations, Database, Message, Messages, User, Users

log = logging.getLogger(__name__)

STATUS_FOR_FINISH = {"stop": "complete", "tool_calls": "complete", "length": "incomplete", "abort": "stopped", "content_filter": "filtered"}
UNSET = object()


@dataclass
class GenerationOptions:
    user: User  # the caller: their tier sets quotas, caps and queue priority
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    reasoning_effort: str | None = None  # low | medium | high: think before answering
    tools: ToolUse | None = None  # the chat tools the model may call (set by the service)

    def ask(self, request_id: str) -> Ask:
        return Ask(user=self.user, model=self.model, max_tokens=self.max_tokens, temperature=self.temperature,
                   reasoning_effort=self.reasoning_effort, request_id=request_id, param="text", tools=self.tools)


@dataclass
class Generation:
    """A running (or recently finished) answer."""

    conversation_id: str
    user_message_id: str  # the message being answered
    message_id: str  # the assistant message being written
    run: Run
    log: EventLog
    summary_ids: int = 0  # summary requests made so far (each has its own request id)
    stop_requested: bool = False
    task: asyncio.Task | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    # The answer so far, continued from here: saved text (i12 recovery, app/recovery.py) or, taken over
    # from a gateway that died, the text its log already holds (prefix_logged: readers have it).
    prefix: str = ""
    prefix_logged: bool = False
    abandoned: bool = False  # another gateway has the job: end here without saving anything
    tokens_before: int = 0  # answer tokens the taken-over prefix already had (its log says how many)

    def answer_tokens(self) -> int:
        """Answer tokens so far, as logged beside each piece for a gateway that may take this over."""
        return self.tokens_before + self.run.usage.completion_tokens

    def next_summary_id(self) -> str:
        self.summary_ids += 1
        return f"{self.message_id}-summary-{self.summary_ids - 1}"


@dataclass
class _Outcome:
    answer: list[str] = field(default_factory=list)  # as shown: thinking and held-back text excluded
    thinking: list[str] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)  # tool calls and their results, in order
    finish_reason: str | None = None
    error: Exception | None = None


class ConversationService:
    def __init__(self, db: Database, pipeline: Pipeline, settings: Settings, logs: EventLogStore) -> None:
        self.db = db
        self.pipeline = pipeline
        self.backend = pipeline.backend
        self.settings = settings
        self.logs = logs
        self.prompts = PromptAssembler(db, pipeline.backend, settings, lambda: pipeline.context_window)
        self._running: dict[str, Generation | None] = {}
        self.jobs: Jobs = MemoryJobs()  # which gateway runs each conversation's answer (Redis: the fleet)
        self.draining = False  # shutting down: no new answers here
        names = [n.strip() for n in settings.chat_tools.split(",") if n.strip()]
        self.tools: ToolRegistry = builtin_registry(names)

    # -- starting generations ----------------------------------------------------------
    def running(self, conversation_id: str) -> Generation | None:
        return self._running.get(conversation_id)

    def running_count(self) -> int:
        return sum(1 for g in self._running.values() if g is not None)

    def _claim(self, conversation_id: str) -> None:
        if conversation_id in self._running:
            raise ApiError(409, "an answer is already being generated in this conversation; stop it first",
                           "generation_in_progress")
        # A placeholder until the generation exists, so two requests cannot both pass the check.
        self._running[conversation_id] = None

    def _unclaim(self, conversation_id: str) -> None:
        if conversation_id in self._running and self._running[conversation_id] is None:
            del self._running[conversation_id]

    async def _claim_fleet(self, conversation_id: str) -> bool:
        """Hold the conversation across the fleet: another gateway may be answering in it."""
        if self.draining:
            raise ApiError(503, "this gateway is shutting down; retry (another gateway will answer)",
                           "shutting_down", headers={"Retry-After": "1"})
        if not await self.jobs.claim(conversation_id):
            raise ApiError(409, "an answer is already being generated in this conversation (on another "
                           "gateway); stop it first", "generation_in_progress")
        return True

    async def send(self, session: AsyncSession, conv: Conversation, text: str, options: GenerationOptions,
                   parent_id: object = UNSET) -> Generation:
        """Save a user message (under parent_id, or at the end of the active branch) and start its answer."""
        if len(text) > self.settings.max_message_chars:
            raise ApiError(400, f"the message is too long: {len(text)} characters, at most "
                           f"{self.settings.max_message_chars} allowed", "message_too_long", "text")
        self._claim(conv.id)
        run = None
        claimed = False
        try:
            claimed = await self._claim_fleet(conv.id)
            tree = Tree(await Messages(session).all_in(conv.id))
            parent = self._parent(tree, conv, parent_id)
            run = await self.pipeline.open(self._with_tools(options).ask(""), moderate=text)  # before model work
            text_tokens = await off_loop(self.backend.count_tokens, text, size=len(text))  # i12: large input
            self.prompts.check_fits(text_tokens, run.max_tokens)
            history = [m.tokens for m in tree.path_to(parent)] if parent is not None else []
            await run.reserve(self.prompts.estimate(history + [text_tokens], run.max_tokens))
            messages = Messages(session)
            user_msg = await messages.add(conv.id, parent, "user", text, text_tokens)
            answer = await messages.add(conv.id, user_msg.id, "assistant", "", 0, run.limits.model,
                                        status="incomplete")
            values = {"current_leaf_id": answer.id}
            if conv.title is None and not tree.by_id:
                values["title"] = make_title(text, self.settings.title_chars)
            await Conversations(session).touch(conv.id, **values)
            await session.commit()
            return await self._start(conv.id, user_msg.id, answer.id, run)
        except BaseException:
            self._unclaim(conv.id)
            if claimed:
                await self.jobs.release(conv.id)
            if run is not None:
                await run.close()
            raise

    def _with_tools(self, options: GenerationOptions) -> GenerationOptions:
        if not self.tools or options.reasoning_effort is not None:  # tools and thinking are not mixed
            return options
        return GenerationOptions(options.user, options.model, options.max_tokens, options.temperature,
                                 options.reasoning_effort, self.tools.tool_use())

    @staticmethod
    def _parent(tree: Tree, conv: Conversation, parent_id: object) -> str | None:
        if parent_id is UNSET:
            return tree.default_leaf(conv.current_leaf_id)
        if parent_id is None:
            return None
        if parent_id not in tree:
            raise ApiError(400, f"parent_id {parent_id!r} is not a message of this conversation",
                           "invalid_parent", "parent_id")
        if tree.by_id[parent_id].role != "assistant":
            raise ApiError(400, "parent_id must be an assistant message (to edit a message, send the new text "
                           "with the edited message's parent_id)", "invalid_parent", "parent_id")
        return parent_id  # type: ignore[return-value]

    async def regenerate(self, session: AsyncSession, conv: Conversation, message_id: str,
                         options: GenerationOptions) -> Generation:
        """A new answer beside an assistant message (or under a user message)."""
        self._claim(conv.id)
        run = None
        claimed = False
        try:
            claimed = await self._claim_fleet(conv.id)
            run = await self.pipeline.open(self._with_tools(options).ask(""))
            target = await Messages(session).get(conv.id, message_id)
            if target is None:
                raise not_found("message")
            question_id = target.id if target.role == "user" else target.parent_id
            if question_id is None:
                raise ApiError(400, "this message has no user message to answer", "invalid_message")
            tree = Tree(await Messages(session).all_in(conv.id))
            await run.reserve(self.prompts.estimate([m.tokens for m in tree.path_to(question_id)], run.max_tokens))
            answer = await Messages(session).add(conv.id, question_id, "assistant", "", 0, run.limits.model,
                                                 status="incomplete")
            await Conversations(session).touch(conv.id, current_leaf_id=answer.id)
            await session.commit()
            return await self._start(conv.id, question_id, answer.id, run)
        except BaseException:
            self._unclaim(conv.id)
            if claimed:
                await self.jobs.release(conv.id)
            if run is not None:
                await run.close()
            raise

    async def _start(self, conversation_id: str, question_id: str, answer_id: str, run: Run,
                     prefix: str = "") -> Generation:
        run.request_id = answer_id  # stop() and the engine know the answer by its message id
        gen = Generation(conversation_id, question_id, answer_id, run, await self.logs.create(answer_id),
                         prefix=prefix)
        await self.logs.set_pointer(conversation_id, answer_id)  # for GET /conversations/{id}/stream
        await self.jobs.update(JobRecord(conversation_id, self.jobs.gateway, answer_id, spec={
            "user_message_id": question_id, "user_id": run.ask.user.id, "model": run.limits.model,
            "max_tokens": run.max_tokens, "temperature": run.limits.temperature, "top_p": run.limits.top_p,
            "effort": run.limits.effort, "reservation": reservation_spec(run.reservation)}))
        self._running[conversation_id] = gen
        gen.task = asyncio.create_task(self._run(gen), name=f"generation-{answer_id}")
        start_checkpointer(self, gen)  # i12 recovery: the text so far reaches the database every interval
        return gen

    # -- stopping --------------------------------------------------------------------
    async def stop(self, conversation_id: str, timeout: float = 10.0) -> Generation | None:
        """Abort the running answer (the engine frees its blocks at once) and wait until it is saved."""
        gen = self._running.get(conversation_id)
        if gen is None:
            return None
        gen.stop_requested = True
        gen.run.stop()
        if gen.summary_ids:  # a summary may be running under its own id
            self.backend.abort(f"{gen.message_id}-summary-{gen.summary_ids - 1}")
        try:
            await asyncio.wait_for(gen.finished.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("generation %s did not stop within %.0f s", gen.message_id, timeout)
        return gen

    async def shutdown(self, grace_s: float = 0.0, hand_over: bool = False) -> None:
        """Take no new answers; give the running ones `grace_s` to finish; then hand the rest over to
        the other gateways (hand_over: their leases lapse and another gateway continues them) or, alone,
        stop them (saved as 'stopped')."""
        self.draining = True
        running = [g for g in self._running.values() if g is not None]
        if running and grace_s > 0:
            await asyncio.wait([asyncio.ensure_future(g.finished.wait()) for g in running], timeout=grace_s)
        left = [cid for cid, g in list(self._running.items()) if g is not None]
        if not hand_over:
            await asyncio.gather(*(self.stop(cid) for cid in left))
            return
        for cid in left:
            log.warning("handing the answer of conversation %s over to another gateway", cid)
            forget = getattr(self.jobs, "forget", None)
            if forget is not None:
                forget(cid)  # stop renewing: the lease lapses and another gateway takes the job
            await self.abandon(cid)

    async def abandon(self, conversation_id: str, timeout: float = 5.0) -> None:
        """End the answer here without saving it: another gateway has it (or will take it over)."""
        gen = self._running.get(conversation_id)
        if gen is None:
            return
        gen.abandoned = gen.stop_requested = True
        gen.run.stop()
        try:
            await asyncio.wait_for(gen.finished.wait(), timeout)
        except asyncio.TimeoutError:
            if gen.task is not None:
                gen.task.cancel()

    # -- taking over the answer of a gateway that died ---------------------------------
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
        if message is None or message.status != "incomplete" or user is None:
            log.warning("answer %s is not continued: %s", record.message_id, "it was deleted" if message is None
                        else f"it is already {message.status}" if user is None or message.status != "incomplete"
                        else "its user is gone")
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
        gen = Generation(record.conversation_id, spec["user_message_id"], record.message_id, run, event_log,
                         prefix=prefix, prefix_logged=True, tokens_before=used)
        self._running[record.conversation_id] = gen
        if remaining <= 0:  # it had used its whole budget: it ends as its own gateway would have ended it
            gen.task = asyncio.create_task(self._finish(gen, _Outcome(answer=[prefix], finish_reason="length")),
                                           name=f"continuation-{record.message_id}")
            return True
        start_checkpointer(self, gen)  # i12: the continued text reaches the database every interval
        gen.task = asyncio.create_task(self._run(gen), name=f"continuation-{record.message_id}")
        return True

    # -- the job ---------------------------------------------------------------------------
    async def _run(self, gen: Generation) -> None:
        out = _Outcome(answer=[gen.prefix] if gen.prefix_logged else [])
        run = gen.run
        try:
            messages = await self.prompts.assemble(gen.conversation_id, gen.user_message_id, run.limits.model,
                                                   run.max_tokens, gen.next_summary_id, run.charge,
                                                   lambda request: admitted_summary(run, request))  # i12
            if gen.stop_requested:
                raise GenerationStopped
            if gen.prefix:  # the saved (or logged) text opens the assistant's turn; readers see it whole
                if not gen.prefix_logged:  # i12 recovery: a fresh log
                    await self._write(gen, AnswerText(gen.prefix), out)

            async def position(n: int) -> None:
                if not gen.log.closed:
                    await gen.log.append({"queue_position": n})

            tools = run.ask.tools
            messages = render_messages(messages, tools)
            # Recovery and takeover: the saved text is the open assistant turn the first round continues.
            first = messages + [{"role": "assistant", "content": gen.prefix}] if gen.prefix else messages
            await run.admit(ChatPrompt(first, continue_final=bool(gen.prefix)), position)
            for round_no in range(self.settings.max_tool_calls_per_answer + 1):
                text, calls = ([gen.prefix] if gen.prefix and round_no == 0 else []), []
                async for piece in run.stream():
                    await self._write(gen, piece, out)
                    if isinstance(piece, AnswerText):
                        text.append(piece.text)
                    elif isinstance(piece, ToolCall):
                        calls.append(piece)
                if out.finish_reason != "tool_calls" or gen.stop_requested:
                    break
                messages = await self._run_tools(gen, run, messages, "".join(text), calls, out)
                if gen.stop_requested:
                    raise GenerationStopped
                await run.resume(ChatPrompt(messages), f"{gen.message_id}-round-{round_no + 1}")
        except (GenerationStopped, ConversationDeleted, SummaryAborted):
            out.finish_reason = "abort"
        except (ApiError, BadGenerationRequest, BackendError) as exc:  # quota top-up refused, queue timeout, backend
            out.error = exc
        except asyncio.CancelledError:
            out.finish_reason = "abort"
            await self._finish(gen, out)
            raise
        except LogTakenOver:
            await self._another_writer(gen, out)
        except Exception as exc:  # keep the job's failure in the conversation, not in a log nobody reads
            log.exception("generation %s failed", gen.message_id)
            out.error = exc
        await self._finish(gen, out)

    async def _another_writer(self, gen: Generation, out: _Outcome) -> None:
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
        gen.log = event_log
        out.answer = [logged_text(await self.logs.events(gen.message_id))]
        out.error = RuntimeError("a gateway that had lost this answer wrote to it after it was taken over")

    async def _run_tools(self, gen: Generation, run: Run, messages: list[dict], text: str, calls: list[ToolCall],
                         out: _Outcome) -> list[dict]:
        """Run a round's calls; the prompt for the next round (the round's turn, then one turn per result)."""
        ctx = ToolContext(run.ask.user, self.db, gen.conversation_id)
        budget = self.settings.max_tool_calls_per_answer
        turns = [{"role": "assistant", "content": "\n".join([text] * bool(text) + [c.text() for c in calls])}]
        for call in calls:
            if len(out.steps) >= budget:
                result_event = {"id": call.id, "name": call.name, "output": "",
                                "error": f"the limit of {budget} tool calls per answer is reached"}
                model_text = f"error: {result_event['error']}"
            else:
                result = await self.tools.run(call, ctx)
                result_event, model_text = result.event(), result.model_text()
            out.steps.append({"arguments": call.arguments, **result_event})
            await gen.log.append({"tool_result": result_event})
            turns.append({"role": "tool", "content": model_text})
        if len(out.steps) >= budget:  # no more calls: the next round is read as plain text
            run.ask = replace(run.ask, tools=replace(run.ask.tools, choice="none"))
        return messages + turns

    @staticmethod
    async def _write(gen: Generation, piece: object, out: _Outcome) -> None:
        if isinstance(piece, ToolCall):
            await gen.log.append({"tool_call": {"id": piece.id, "name": piece.name, "arguments": piece.arguments}})
        # PostgreSQL text cannot hold NUL: drop it here, so what is streamed is exactly what is saved.
        elif isinstance(piece, AnswerText):
            text = piece.text.replace("\x00", "")
            out.answer.append(text)
            await gen.log.append({"token": text}, answer_tokens=gen.answer_tokens())
        elif isinstance(piece, Thinking):
            text = piece.text.replace("\x00", "")
            out.thinking.append(text)
            await gen.log.append({"thinking": text})
        elif isinstance(piece, Finished):
            out.finish_reason = piece.finish_reason

    async def _finish(self, gen: Generation, out: _Outcome) -> None:
        if gen.abandoned:  # another gateway has the job: it saves the answer and settles the quota
            gen.run.drop()
            if self._running.get(gen.conversation_id) is gen:
                del self._running[gen.conversation_id]
            gen.finished.set()
            return
        try:
            await gen.run.close()  # settle, meter, observe: before the client hears 'done'
            reason = out.finish_reason or ("error" if out.error else "abort")
            status = "error" if out.error else STATUS_FOR_FINISH.get(reason, "incomplete")
            text = "".join(out.answer)
            values = {"text": text, "tokens": self._count(text), "status": status,
                      "reasoning": "".join(out.thinking) or None, "tool_steps": out.steps or None,
                      "finish_reason": None if out.error else reason,
                      "prompt_tokens": gen.run.usage.prompt_tokens or None}
            if out.error is not None:
                values["error"] = str(out.error) or type(out.error).__name__
            try:
                async with self.db.session() as session:
                    await Messages(session).finish(gen.message_id, **values)
                    await Conversations(session).touch(gen.conversation_id)
                    await session.commit()
            except Exception:
                log.exception("could not save the answer %s", gen.message_id)
            if out.error is not None:
                await gen.log.append({**error_event(out.error), "message_id": gen.message_id}, event="error")
            else:
                usage: Usage = gen.run.usage
                await gen.log.append({
                    "done": True, "message_id": gen.message_id, "user_message_id": gen.user_message_id,
                    "conversation_id": gen.conversation_id, "status": status, "finish_reason": reason,
                    "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}})
        finally:
            try:
                await gen.log.close()
            finally:
                if self._running.get(gen.conversation_id) is gen:
                    del self._running[gen.conversation_id]
                gen.finished.set()
                try:
                    await self.jobs.release(gen.conversation_id)
                except Exception as exc:  # Redis away: the lease lapses, and the keeper finds the answer saved
                    log.warning("could not release the job of %s: %s", gen.conversation_id, exc)

    def _count(self, text: str) -> int:
        try:
            return self.backend.count_tokens(text) if text else 0
        except BackendError:
            return 0


def make_title(text: str, limit: int = 60) -> str:
    """The first line of the first message, cut at a word boundary."""
    line = re.sub(r"\s+", " ", text.strip().splitlines()[0] if text.strip() else "").strip()
    if len(line) <= limit:
        return line or "New chat"
    cut = line[:limit].rsplit(" ", 1)[0] if " " in line[:limit] else line[:limit]
    return cut.rstrip(" ,.;:") + "…"
