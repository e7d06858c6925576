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
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.admission import INTERACTIVE, REASONING, Slot
from chatloom.app.branches import Tree
from chatloom.app.errors import ApiError, not_found
from chatloom.app.events import EventLog, EventLogStore
from chatloom.app.continuation import can_continue, continuation_prompt, logged_text
from chatloom.app.hotstate.job_keeper import reservation_of, reservation_spec
from chatloom.app.hotstate.jobs import JobRecord, Jobs, MemoryJobs
from chatloom.app.hotstate.redis_events import LogTakenOver
from chatloom.app import reasoning
from chatloom.app.prompt import (SUMMARY_HEADER, TemplateCost, Turn, build_messages, chunk_turns, plan_prompt,
                                 summarizer_messages)
from chatloom.app.quotas import Reservation
from chatloom.app.settings import Settings
from chatloom.app.tiers import Tier
from chatloom.serving import Backend, BackendError, BadGenerationRequest, GenerationRequest
from chatloom.store import Conversation, Conversations, Database, Message, Messages, User, Users

if TYPE_CHECKING:
    from chatloom.app.traffic import Traffic

log = logging.getLogger(__name__)

STATUS_FOR_FINISH = {"stop": "complete", "length": "incomplete", "abort": "stopped", "content_filter": "filtered"}
UNSET = object()


@dataclass
class GenerationOptions:
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    user: User | None = None  # the caller: their tier sets quotas, caps and queue priority
    reasoning_effort: str | None = None  # low | medium | high: think before answering


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
    user: User | None = None
    tier: Tier | None = None
    reservation: Reservation | None = None
    effort: str | None = None  # set: a reasoning request with this effort
    queued: asyncio.Future | None = None  # the wait in the admission queue, while it lasts
    summary_tokens: list[int] = field(default_factory=lambda: [0, 0])  # [prompt, completion] spent summarizing
    task: asyncio.Task | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    prefix: str = ""  # taken over from a gateway that died: the answer so far, continued from here
    abandoned: bool = False  # another gateway took the job: end here without saving anything


class _Stopped(Exception):
    pass


class _NoSlot:
    """Admission when the service runs without traffic control (a bare ConversationService)."""

    def started(self) -> None:
        pass

    def release(self) -> None:
        pass


class ConversationService:
    def __init__(self, db: Database, backend: Backend, settings: Settings, logs: EventLogStore,
                 traffic: "Traffic | None" = None) -> None:
        self.db = db
        self.backend = backend
        self.settings = settings
        self.logs = logs
        self.traffic = traffic
        self._running: dict[str, Generation] = {}
        self._cost: TemplateCost | None = None
        self.jobs: Jobs = MemoryJobs()  # which gateway runs each conversation's answer (Redis: the fleet)
        self.draining = False  # shutting down: no new answers here

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

    def _tier(self, options: GenerationOptions) -> Tier | None:
        return self.traffic.tier(options.user) if self.traffic is not None and options.user is not None else None

    def _resolve_options(self, options: GenerationOptions) -> tuple[str, int, float]:
        model = self.backend.resolve_model(options.model)
        tier = self._tier(options)
        if tier is not None:
            self.traffic.check_model(tier, model)
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
        if tier is not None:
            max_tokens = self.traffic.cap_max_tokens(tier, max_tokens)
        effort = self.traffic.effort(options.reasoning_effort) if self.traffic is not None else None
        if effort is not None:  # room for the thinking on top of the answer, within the window
            max_tokens = min(max_tokens + reasoning.BUDGET_TOKENS[effort], (window + max_tokens) // 2)
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

    async def _claim(self, conversation_id: str) -> bool:
        """Hold the conversation across the fleet: another gateway may be answering in it."""
        if self.draining:
            raise ApiError(503, "this gateway is shutting down; retry (another gateway will answer)",
                           "shutting_down", headers={"Retry-After": "1"})
        if not await self.jobs.claim(conversation_id):
            raise ApiError(409, "an answer is already being generated in this conversation (on another "
                           "gateway); stop it first", "generation_in_progress")
        return True

    async def send(self, session: AsyncSession, conv: Conversation, text: str, parent_id: object = UNSET,
                   options: GenerationOptions | None = None) -> Generation:
        """Save a user message (under parent_id, or at the end of the active branch) and start its answer."""
        reservation = None
        claimed = False
        self._reserve(conv.id)
        try:
            claimed = await self._claim(conv.id)
            options = options or GenerationOptions()
            model, max_tokens, temperature = self._resolve_options(options)
            if len(text) > self.settings.max_message_chars:
                raise ApiError(400, f"the message is too long: {len(text)} characters, at most "
                               f"{self.settings.max_message_chars} allowed", "message_too_long", "text")
            if self.traffic is not None:  # before any model work or anything saved
                self.traffic.check_input(text)
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
            history = [m.tokens for m in tree.path_to(parent)] if parent is not None else []
            reservation = await self._reserve_quota(options, history + [text_tokens], max_tokens)
            messages = Messages(session)
            user_msg = await messages.add(conv.id, parent, "user", text, text_tokens)
            answer = await messages.add(conv.id, user_msg.id, "assistant", "", 0, model, status="incomplete")
            values = {"current_leaf_id": answer.id}
            if conv.title is None and not tree.by_id:
                values["title"] = make_title(text, self.settings.title_chars)
            await Conversations(session).touch(conv.id, **values)
            await session.commit()
            return await self._start(conv.id, user_msg.id, answer.id, model, max_tokens, temperature,
                                     options, reservation)
        except BaseException:
            self._release(conv.id)
            if claimed:
                await self.jobs.release(conv.id)
            await self._settle(reservation, 0)
            raise

    async def regenerate(self, session: AsyncSession, conv: Conversation, message_id: str,
                         options: GenerationOptions | None = None) -> Generation:
        """A new answer beside an assistant message (or under a user message)."""
        reservation = None
        claimed = False
        self._reserve(conv.id)
        try:
            claimed = await self._claim(conv.id)
            model, max_tokens, temperature = self._resolve_options(options or GenerationOptions())
            target = await Messages(session).get(conv.id, message_id)
            if target is None:
                raise not_found("message")
            question_id = target.id if target.role == "user" else target.parent_id
            if question_id is None:
                raise ApiError(400, "this message has no user message to answer", "invalid_message")
            tree = Tree(await Messages(session).all_in(conv.id))
            reservation = await self._reserve_quota(options or GenerationOptions(),
                                              [m.tokens for m in tree.path_to(question_id)], max_tokens)
            answer = await Messages(session).add(conv.id, question_id, "assistant", "", 0, model, status="incomplete")
            await Conversations(session).touch(conv.id, current_leaf_id=answer.id)
            await session.commit()
            return await self._start(conv.id, question_id, answer.id, model, max_tokens, temperature,
                                     options or GenerationOptions(), reservation)
        except BaseException:
            self._release(conv.id)
            if claimed:
                await self.jobs.release(conv.id)
            await self._settle(reservation, 0)
            raise

    async def _reserve_quota(self, options: GenerationOptions, turn_tokens: list[int], max_tokens: int) -> Reservation | None:
        """Reserve the prompt (estimated from stored counts, as prompt assembly will) plus max_tokens."""
        tier = self._tier(options)
        if tier is None:
            return None
        system = self.backend.count_tokens(self.settings.system_prompt)
        prompt = min(self.template_cost.prompt(system, turn_tokens), self.context_window - max_tokens)
        return await self.traffic.reserve(options.user, tier, prompt + max_tokens)

    async def _settle(self, reservation: Reservation | None, used: int) -> None:
        if reservation is not None and self.traffic is not None:
            await self.traffic.quotas.settle(reservation, used)

    async def _start(self, conversation_id: str, question_id: str, answer_id: str, model: str,
                     max_tokens: int, temperature: float, options: GenerationOptions | None = None,
                     reservation: Reservation | None = None) -> Generation:
        options = options or GenerationOptions()
        gen = Generation(conversation_id, question_id, answer_id, model, max_tokens, temperature,
                         await self.logs.create(answer_id), request_id=answer_id, user=options.user,
                         tier=self._tier(options), reservation=reservation,
                         effort=self.traffic.effort(options.reasoning_effort) if self.traffic else None)
        await self.logs.set_pointer(conversation_id, answer_id)  # for GET /conversations/{id}/stream
        await self.jobs.update(JobRecord(conversation_id, self.jobs.gateway, answer_id, spec={
            "user_message_id": question_id, "model": model, "max_tokens": max_tokens, "temperature": temperature,
            "user_id": options.user.id if options.user else None, "effort": gen.effort,
            "reservation": reservation_spec(reservation)}))
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
        if gen.queued is not None:  # still waiting for room: leave the queue
            gen.queued.cancel()
        self.backend.abort(gen.request_id)
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
        if hand_over:
            for cid in left:
                log.warning("handing the answer of conversation %s over to another gateway", cid)
                forget = getattr(self.jobs, "forget", None)
                if forget is not None:
                    forget(cid)  # stop renewing: the lease lapses and another gateway takes the job
                await self.abandon(cid)
            return
        await asyncio.gather(*(self.stop(cid) for cid in left))

    async def abandon(self, conversation_id: str, timeout: float = 5.0) -> None:
        """End the answer here without saving it: another gateway has it (or will take it over)."""
        gen = self._running.get(conversation_id)
        if gen is None:
            return
        gen.abandoned = gen.stop_requested = True
        if gen.queued is not None:
            gen.queued.cancel()
        self.backend.abort(gen.request_id)
        try:
            await asyncio.wait_for(gen.finished.wait(), timeout)
        except asyncio.TimeoutError:
            if gen.task is not None:
                gen.task.cancel()

    # -- taking over the answer of a gateway that died ---------------------------------
    async def resume_job(self, record: JobRecord) -> bool:
        """Continue a taken-over answer from the text its log holds; False when it cannot be continued."""
        spec = record.spec
        if spec.get("effort"):
            return False  # the hidden thinking is not logged, so a reasoning answer cannot go on
        reopen = getattr(self.logs, "open_for_writing", None)
        event_log = await reopen(record.message_id) if reopen is not None else None
        if event_log is None:
            return False
        async with self.db.session() as session:
            message = await session.get(Message, record.message_id)
            user = await Users(session).get(spec["user_id"]) if spec.get("user_id") else None
        if message is None or message.status != "incomplete":
            return False  # deleted, or saved by its gateway after all
        prefix = logged_text(await self.logs.events(record.message_id))
        remaining = spec["max_tokens"] - self._count(prefix)
        if remaining <= 0 or not can_continue(self.backend):
            return False
        gen = Generation(record.conversation_id, spec["user_message_id"], record.message_id, spec["model"],
                         remaining, spec["temperature"], event_log, request_id=f"{record.message_id}-cont",
                         user=user, tier=self.traffic.tier(user) if self.traffic and user else None,
                         reservation=reservation_of(spec), prefix=prefix)
        self._running[record.conversation_id] = gen
        gen.task = asyncio.create_task(self._run(gen), name=f"continuation-{record.message_id}")
        return True

    # -- the job ---------------------------------------------------------------------------
    async def _run(self, gen: Generation) -> None:
        parts: list[str] = [gen.prefix] if gen.prefix else []  # the answer as shown (thinking, held-back text excluded)
        outcome: dict = {}
        seen = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}  # counts so far, for settling
        error: Exception | None = None
        slot: Slot | None = None
        try:
            messages = await self._assemble(gen)
            if gen.stop_requested:
                raise _Stopped
            if gen.effort is not None:
                messages = reasoning.with_instructions(messages, gen.effort)
            slot = await self._admit(gen, messages)
            if gen.stop_requested:
                raise _Stopped
            gen.request_id = gen.message_id if not gen.prefix else f"{gen.message_id}-cont"
            # The engine runs low priority numbers first; higher tiers get lower numbers.
            request = GenerationRequest(messages=messages, model=gen.model, max_tokens=gen.max_tokens,
                                        temperature=gen.temperature, top_p=self.settings.default_top_p,
                                        request_id=gen.request_id, priority=-gen.tier.priority if gen.tier else 0)
            if gen.prefix:  # a taken-over answer: go on from the text already sent
                request.messages, request.prompt = None, continuation_prompt(self.backend, messages, gen.prefix)
            guard = self.traffic.output_guard() if self.traffic is not None else None
            splitter = reasoning.ThinkingSplitter() if gen.effort is not None else None
            aborted = False
            async for delta in self.backend.stream(request):
                slot.started()
                if gen.stop_requested and not aborted:  # a stop that raced the request's start
                    self.backend.abort(gen.request_id)
                    aborted = True
                seen.update(prompt_tokens=delta.prompt_tokens, completion_tokens=delta.completion_tokens,
                            cached_tokens=delta.cached_tokens)
                if delta.text and not (guard and guard.verdict):
                    pieces = splitter.push(delta.text) if splitter else [("answer", delta.text)]
                    if delta.finished and splitter:
                        pieces += splitter.finish()
                    await self._emit(gen, pieces, guard, parts)
                if delta.finished:
                    if splitter and not delta.text:
                        await self._emit(gen, splitter.finish(), guard, parts)
                    if guard and not guard.verdict:
                        await self._emit_answer(gen, guard.finish(), parts)
                    if guard and guard.verdict and not aborted:
                        self.traffic.output_blocked(guard)
                    reason = "content_filter" if guard and guard.verdict else delta.finish_reason
                    outcome = {"finish_reason": reason, "prompt_tokens": delta.prompt_tokens,
                               "completion_tokens": delta.completion_tokens, "cached_tokens": delta.cached_tokens,
                               "metrics": delta.metrics}
                elif guard and guard.verdict and not aborted:
                    # Caught before the user saw it: stop the model now; the stream ends as content_filter.
                    self.traffic.output_blocked(guard)
                    self.backend.abort(gen.request_id)
                    aborted = True
        except _Stopped:
            outcome = {"finish_reason": "abort", **seen}
        except ApiError as exc:  # a quota top-up refused, or no room in the queue in time
            error = exc
        except (BadGenerationRequest, BackendError) as exc:
            error = exc
        except asyncio.CancelledError:
            outcome = {"finish_reason": "abort", **seen}
            if slot is not None:
                slot.release()
            await self._finish(gen, "".join(parts), outcome, None)
            raise
        except LogTakenOver:
            gen.abandoned = True  # another gateway continues this answer
        except Exception as exc:  # keep the job's failure in the conversation, not in a log nobody reads
            log.exception("generation %s failed", gen.message_id)
            error = exc
        finally:
            if slot is not None:
                slot.release()
        if error is not None and not outcome:
            outcome = dict(seen)
        await self._finish(gen, "".join(parts), outcome, error)

    async def _admit(self, gen: Generation, messages: list[dict]) -> Slot | None:
        """Top the quota reservation up to the exact prompt, then wait for room in the engine;
        while waiting, the stream tells its readers their place in the queue."""
        if self.traffic is None:
            return _NoSlot()
        prompt_tokens = self.backend.count_prompt_tokens(messages)
        if gen.reservation is not None and gen.tier is not None and not gen.prefix:
            await self.traffic.extend(gen.reservation, gen.tier, prompt_tokens + gen.max_tokens)

        async def position(n: int) -> None:
            if not gen.log.closed:
                await gen.log.append({"queue_position": n})

        tier = gen.tier or self.traffic.tiers.for_user(None)
        kind = REASONING if gen.effort is not None else INTERACTIVE
        gen.queued = asyncio.ensure_future(self.traffic.admit(tier, prompt_tokens, kind, position))
        try:
            return await gen.queued
        except asyncio.CancelledError:
            # stop() cancelled the wait (not this task): the answer ends as stopped, at no cost.
            if gen.stop_requested and not asyncio.current_task().cancelling():
                raise _Stopped from None
            raise
        finally:
            gen.queued = None

    async def _emit(self, gen: Generation, pieces: list[tuple[str, str]], guard, parts: list[str]) -> None:
        for kind, text in pieces:
            if kind == "thinking":
                await gen.log.append({"thinking": text})
            else:
                await self._emit_answer(gen, guard.push(text) if guard else [text], parts)

    @staticmethod
    async def _emit_answer(gen: Generation, texts: list[str], parts: list[str]) -> None:
        for text in texts:
            parts.append(text)
            await gen.log.append({"token": text})

    async def _finish(self, gen: Generation, text: str, outcome: dict, error: Exception | None) -> None:
        if gen.abandoned:  # another gateway has the job: it saves the answer and settles the quota
            if self._running.get(gen.conversation_id) is gen:
                del self._running[gen.conversation_id]
            gen.finished.set()
            return
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
            await self._account(gen, outcome)
            if error is not None:
                status_code = getattr(error, "status", 500)
                body = {"message": f"generation failed: {error}" if status_code >= 500 and not
                        isinstance(error, ApiError) else str(error),
                        "type": "service_unavailable" if status_code == 503 else
                        ("rate_limit_error" if status_code == 429 else "server_error"),
                        "code": getattr(error, "code", "generation_failed"), "status": status_code}
                extra = {}
                headers = getattr(error, "headers", None) or {}
                if "Retry-After" in headers:
                    extra["retry_after"] = int(headers["Retry-After"])
                await gen.log.append({"error": body, "message_id": gen.message_id, **extra}, event="error")
            else:
                await gen.log.append({
                    "done": True, "message_id": gen.message_id, "user_message_id": gen.user_message_id,
                    "conversation_id": gen.conversation_id, "status": status, "finish_reason": reason,
                    "usage": {"prompt_tokens": outcome.get("prompt_tokens", 0),
                              "completion_tokens": outcome.get("completion_tokens", 0)}})
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

    async def _account(self, gen: Generation, outcome: dict) -> None:
        """Settle the quota with the tokens really used, meter them, observe the request's latencies."""
        prompt, completion = outcome.get("prompt_tokens") or 0, outcome.get("completion_tokens") or 0
        # Summaries of older turns are real model work for this user: they count and are metered too.
        s_prompt, s_completion = gen.summary_tokens
        await self._settle(gen.reservation, prompt + completion + s_prompt + s_completion)
        if self.traffic is None or prompt + completion + s_prompt + s_completion == 0:
            return
        if gen.user is not None:
            await self.traffic.meter.record(gen.user.id, gen.model, prompt + s_prompt, completion + s_completion,
                                            outcome.get("cached_tokens") or 0)
        if prompt + completion == 0:
            return
        self.traffic.metrics.observe_request(outcome.get("metrics"), outcome.get("finish_reason"), prompt, completion)

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
            gen.summary_tokens[0] += result.prompt_tokens  # model work for this user: counted and metered
            gen.summary_tokens[1] += result.completion_tokens
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
