"""Conversations: save the user's message, then run the answer as a background job.

A generation is a job, not a connection: it writes its events to an event log and saves the
answer when it ends, whether or not any client is still reading. One generation runs per
conversation at a time; POST .../stop aborts it and the partial answer is kept as 'stopped'.
"""
from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.branches import Tree
from chatloom.app.errors import ApiError, not_found
from chatloom.app.events import EventLog, EventLogStore
from chatloom.app.prompt import (SUMMARY_HEADER, TemplateCost, Turn, build_messages, chunk_turns, plan_prompt,
                                 summarizer_messages)
from chatloom.app.settings import Settings
from chatloom.serving import Backend, BackendError, BadGenerationRequest, GenerationRequest
from chatloom.store import Conversation, Conversations, Database, Messages

log = logging.getLogger(__name__)

STATUS_FOR_FINISH = {"stop": "complete", "length": "incomplete", "abort": "stopped"}
UNSET = object()


@dataclass
class GenerationOptions:
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None


@dataclass
class Generation:
    """A running (or recently finished) answer."""

    conversation_id: str
    user_message_id: str  # the message being answered
    message_id: str  # the assistant message being written
    model: str
    max_tokens: int
    temperature: float
    log: EventLog
    request_id: str = ""  # the backend request now running (summaries use their own)
    stop_requested: bool = False
    task: asyncio.Task | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class _Stopped(Exception):
    pass


class ConversationService:
    def __init__(self, db: Database, backend: Backend, settings: Settings, logs: EventLogStore) -> None:
        self.db = db
        self.backend = backend
        self.settings = settings
        self.logs = logs
        self._running: dict[str, Generation] = {}
        self._cost: TemplateCost | None = None

    # -- sizes ---------------------------------------------------------------------
    @property
    def context_window(self) -> int:
        window = self.backend.context_window
        if self.settings.context_window:
            window = min(window, self.settings.context_window)
        return window

    @property
    def template_cost(self) -> TemplateCost:
        if self._cost is None:
            self._cost = TemplateCost.measure(self.backend.count_prompt_tokens, self.backend.count_tokens)
        return self._cost

    def _summary_max_tokens(self) -> int:
        return max(16, min(self.settings.summary_max_tokens, self.context_window // 4))

    def _resolve_options(self, options: GenerationOptions) -> tuple[str, int, float]:
        model = self.backend.resolve_model(options.model)
        window = self.context_window
        max_tokens = options.max_tokens
        if max_tokens is None:
            max_tokens = min(self.settings.default_max_tokens, window // 2)
        if max_tokens > self.settings.max_tokens_limit:
            raise ApiError(400, f"max_tokens may be at most {self.settings.max_tokens_limit}",
                           "invalid_value", "max_tokens")
        if max_tokens >= window:
            raise ApiError(400, f"max_tokens must be below the context window ({window} tokens)",
                           "invalid_value", "max_tokens")
        temperature = self.settings.default_temperature if options.temperature is None else options.temperature
        return model, max_tokens, temperature

    def _check_fits(self, text_tokens: int, max_tokens: int) -> None:
        """The new message, the system prompt and the answer must fit the context window on their own."""
        cost = self.template_cost
        needed = cost.prompt(self.backend.count_tokens(self.settings.system_prompt), [text_tokens])
        room = self.context_window - max_tokens
        if needed > room:
            raise ApiError(400, f"the message is too long: it takes {text_tokens} tokens, and with max_tokens="
                           f"{max_tokens} only {max(0, room - (needed - text_tokens))} fit in the "
                           f"{self.context_window}-token context window", "context_length_exceeded", "text")

    # -- starting generations ----------------------------------------------------------
    def running(self, conversation_id: str) -> Generation | None:
        return self._running.get(conversation_id)

    def running_count(self) -> int:
        return sum(1 for g in self._running.values() if g is not None)

    def _reserve(self, conversation_id: str) -> None:
        if conversation_id in self._running:
            raise ApiError(409, "an answer is already being generated in this conversation; stop it first",
                           "generation_in_progress")
        # A placeholder until the generation exists, so two requests cannot both pass the check.
        self._running[conversation_id] = None  # type: ignore[assignment]

    def _release(self, conversation_id: str) -> None:
        if self._running.get(conversation_id, 0) is None:
            del self._running[conversation_id]

    async def send(self, session: AsyncSession, conv: Conversation, text: str, parent_id: object = UNSET,
                   options: GenerationOptions | None = None) -> Generation:
        """Save a user message (under parent_id, or at the end of the active branch) and start its answer."""
        self._reserve(conv.id)
        try:
            options = options or GenerationOptions()
            model, max_tokens, temperature = self._resolve_options(options)
            if len(text) > self.settings.max_message_chars:
                raise ApiError(400, f"the message is too long: {len(text)} characters, at most "
                               f"{self.settings.max_message_chars} allowed", "message_too_long", "text")
            text_tokens = self.backend.count_tokens(text)
            self._check_fits(text_tokens, max_tokens)
            tree = Tree(await Messages(session).all_in(conv.id))
            if parent_id is UNSET:
                parent = tree.default_leaf(conv.current_leaf_id)
            elif parent_id is None:
                parent = None
            else:
                if parent_id not in tree:
                    raise ApiError(400, f"parent_id {parent_id!r} is not a message of this conversation",
                                   "invalid_parent", "parent_id")
                if tree.by_id[parent_id].role != "assistant":
                    raise ApiError(400, "parent_id must be an assistant message (to edit a message, "
                                   "send the new text with the edited message's parent_id)", "invalid_parent",
                                   "parent_id")
                parent = parent_id
            messages = Messages(session)
            user_msg = await messages.add(conv.id, parent, "user", text, text_tokens)
            answer = await messages.add(conv.id, user_msg.id, "assistant", "", 0, model, status="incomplete")
            values = {"current_leaf_id": answer.id}
            if conv.title is None and not tree.by_id:
                values["title"] = make_title(text, self.settings.title_chars)
            await Conversations(session).touch(conv.id, **values)
            await session.commit()
            return await self._start(conv.id, user_msg.id, answer.id, model, max_tokens, temperature)
        except BaseException:
            self._release(conv.id)
            raise

    async def regenerate(self, session: AsyncSession, conv: Conversation, message_id: str,
                         options: GenerationOptions | None = None) -> Generation:
        """A new answer beside an assistant message (or under a user message)."""
        self._reserve(conv.id)
        try:
            model, max_tokens, temperature = self._resolve_options(options or GenerationOptions())
            target = await Messages(session).get(conv.id, message_id)
            if target is None:
                raise not_found("message")
            question_id = target.id if target.role == "user" else target.parent_id
            if question_id is None:
                raise ApiError(400, "this message has no user message to answer", "invalid_message")
            answer = await Messages(session).add(conv.id, question_id, "assistant", "", 0, model, status="incomplete")
            await Conversations(session).touch(conv.id, current_leaf_id=answer.id)
            await session.commit()
            return await self._start(conv.id, question_id, answer.id, model, max_tokens, temperature)
        except BaseException:
            self._release(conv.id)
            raise

    async def _start(self, conversation_id: str, question_id: str, answer_id: str, model: str,
                     max_tokens: int, temperature: float) -> Generation:
        gen = Generation(conversation_id, question_id, answer_id, model, max_tokens, temperature,
                         await self.logs.create(answer_id), request_id=answer_id)
        self._running[conversation_id] = gen
        gen.task = asyncio.create_task(self._run(gen), name=f"generation-{answer_id}")
        return gen

    # -- stopping --------------------------------------------------------------------
    async def stop(self, conversation_id: str, timeout: float = 10.0) -> Generation | None:
        """Abort the running answer (the engine frees its blocks at once) and wait until it is saved."""
        gen = self._running.get(conversation_id)
        if gen is None:
            return None
        gen.stop_requested = True
        self.backend.abort(gen.request_id)
        try:
            await asyncio.wait_for(gen.finished.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("generation %s did not stop within %.0f s", gen.message_id, timeout)
        return gen

    async def shutdown(self) -> None:
        await asyncio.gather(*(self.stop(cid) for cid, g in list(self._running.items()) if g is not None))

    # -- the job ---------------------------------------------------------------------------
    async def _run(self, gen: Generation) -> None:
        parts: list[str] = []
        outcome: dict = {}
        error: Exception | None = None
        try:
            messages = await self._assemble(gen)
            if gen.stop_requested:
                raise _Stopped
            gen.request_id = gen.message_id
            request = GenerationRequest(messages=messages, model=gen.model, max_tokens=gen.max_tokens,
                                        temperature=gen.temperature, top_p=self.settings.default_top_p,
                                        request_id=gen.request_id)
            aborted = False
            async for delta in self.backend.stream(request):
                if gen.stop_requested and not aborted:  # a stop that raced the request's start
                    self.backend.abort(gen.request_id)
                    aborted = True
                if delta.text:
                    parts.append(delta.text)
                    await gen.log.append({"token": delta.text})
                if delta.finished:
                    outcome = {"finish_reason": delta.finish_reason, "prompt_tokens": delta.prompt_tokens,
                               "completion_tokens": delta.completion_tokens}
        except _Stopped:
            outcome = {"finish_reason": "abort", "prompt_tokens": 0, "completion_tokens": 0}
        except (BadGenerationRequest, BackendError) as exc:
            error = exc
        except asyncio.CancelledError:
            outcome = {"finish_reason": "abort", "prompt_tokens": 0, "completion_tokens": 0}
            await self._finish(gen, "".join(parts), outcome, None)
            raise
        except Exception as exc:  # keep the job's failure in the conversation, not in a log nobody reads
            log.exception("generation %s failed", gen.message_id)
            error = exc
        await self._finish(gen, "".join(parts), outcome, error)

    async def _finish(self, gen: Generation, text: str, outcome: dict, error: Exception | None) -> None:
        try:
            reason = outcome.get("finish_reason") or ("error" if error else "abort")
            status = "error" if error else STATUS_FOR_FINISH.get(reason, "incomplete")
            values = {"text": text, "tokens": self._count(text), "status": status,
                      "finish_reason": None if error else reason, "prompt_tokens": outcome.get("prompt_tokens")}
            if error is not None:
                values["error"] = str(error) or type(error).__name__
            try:
                async with self.db.session() as session:
                    await Messages(session).finish(gen.message_id, **values)
                    await Conversations(session).touch(gen.conversation_id)
                    await session.commit()
            except Exception:
                log.exception("could not save the answer %s", gen.message_id)
            if error is not None:
                body = {"message": f"generation failed: {error}", "type": "server_error",
                        "code": getattr(error, "code", "generation_failed")}
                await gen.log.append({"error": body, "message_id": gen.message_id}, event="error")
            else:
                await gen.log.append({
                    "done": True, "message_id": gen.message_id, "user_message_id": gen.user_message_id,
                    "conversation_id": gen.conversation_id, "status": status, "finish_reason": reason,
                    "usage": {"prompt_tokens": outcome.get("prompt_tokens", 0),
                              "completion_tokens": outcome.get("completion_tokens", 0)}})
        finally:
            await gen.log.close()
            if self._running.get(gen.conversation_id) is gen:
                del self._running[gen.conversation_id]
            gen.finished.set()

    def _count(self, text: str) -> int:
        try:
            return self.backend.count_tokens(text) if text else 0
        except BackendError:
            return 0

    # -- prompt assembly -----------------------------------------------------------------
    async def _assemble(self, gen: Generation) -> list[dict]:
        async with self.db.session() as session:
            conv = await Conversations(session).get(gen.conversation_id)
            if conv is None:
                raise _Stopped  # deleted while starting
            tree = Tree(await Messages(session).all_in(conv.id))
            summary, summary_upto = conv.summary, conv.summary_upto
        path = tree.path_to(gen.user_message_id)
        path_ids = [m.id for m in path]
        # A summary belongs to one branch: use it only if it covers a prefix of this one.
        if summary and summary_upto in path_ids:
            rest = path[path_ids.index(summary_upto) + 1:]
        else:
            summary, rest = None, path
        history = [Turn(m.id, m.role, m.text, m.tokens) for m in rest if m.text]
        count = self.backend.count_tokens
        system = self.settings.system_prompt
        budget = self.context_window - gen.max_tokens
        reserve = self._summary_max_tokens() + count(SUMMARY_HEADER)
        plan = plan_prompt(history, budget=budget, cost=self.template_cost, system_tokens=count(system),
                           summary_tokens=count(SUMMARY_HEADER + summary) if summary else 0,
                           summary_reserve=reserve, keep_fraction=self.settings.summary_keep_fraction)
        if not plan.use_summary:
            summary = None
        elif plan.to_summarize:
            new_summary = await self._summarize(gen, summary, plan.to_summarize)
            if new_summary:
                summary = new_summary
                async with self.db.session() as session:
                    await Conversations(session).touch(gen.conversation_id, summary=summary,
                                                       summary_upto=plan.to_summarize[-1].id)
                    await session.commit()
            else:
                summary = None
        kept = list(plan.kept)
        messages = build_messages(system, summary, kept)
        # Stored counts are estimates of the rendered prompt; drop the oldest turns if the exact count disagrees.
        while len(kept) > 1 and self.backend.count_prompt_tokens(messages) > budget:
            kept.pop(0)
            messages = build_messages(system, summary, kept)
        return messages

    async def _summarize(self, gen: Generation, previous: str | None, turns: list[Turn]) -> str | None:
        """Fold `turns` into the running summary, one context-sized chunk at a time."""
        max_tokens = self._summary_max_tokens()
        count = self.backend.count_tokens
        overhead = self.template_cost.prompt(0, [0, 0]) + count(summarizer_messages(None, [])[0]["content"]) \
            + count(summarizer_messages(None, [])[1]["content"]) + 8
        label_tokens = count("Assistant: ") + 1  # each transcript line's label and newline
        summary = previous
        index = 0
        while turns:
            budget = self.context_window - max_tokens - overhead - (count(summary) if summary else 0)
            chunk = chunk_turns(turns, budget, per_turn=label_tokens)[0]
            turns = turns[len(chunk):]
            gen.request_id = f"{gen.message_id}-summary-{index}"
            index += 1
            request = GenerationRequest(messages=summarizer_messages(summary, chunk), model=gen.model,
                                        max_tokens=max_tokens, temperature=0.0, request_id=gen.request_id)
            try:
                result = await self.backend.complete(request)
            except BadGenerationRequest as exc:
                log.warning("summary of %s skipped: %s", gen.conversation_id, exc)
                return summary
            if gen.stop_requested or result.finish_reason == "abort":
                raise _Stopped
            summary = result.text.strip() or summary
        return summary


def make_title(text: str, limit: int = 60) -> str:
    """The first line of the first message, cut at a word boundary."""
    line = re.sub(r"\s+", " ", text.strip().splitlines()[0] if text.strip() else "").strip()
    if len(line) <= limit:
        return line or "New chat"
    cut = line[:limit].rsplit(" ", 1)[0] if " " in line[:limit] else line[:limit]
    return cut.rstrip(" ,.;:") + "…"
