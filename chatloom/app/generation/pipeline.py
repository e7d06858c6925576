"""One generation's trip through the product, written once and used by every API front.

Every answer, whether the conversation API's background job or an OpenAI-compatible request, goes
through the same stages, in this order:

    run = await pipeline.open(ask, moderate=text)  # caps: model allowed for the tier, max_tokens defaulted,
                                                   #   limited and capped, effort capped; input moderation
    await run.reserve(prompt or estimate)          # 400 context_length_exceeded if it can never fit (before
                                                   #   any quota or queue), 503 queue_full at once if the queue
                                                   #   could not take it in time, then the quota reservation (429)
    await run.admit(prompt, on_position)           # exact prompt, reservation topped up, admission (503)
    async for piece in run.stream(): ...           # backend.stream -> thinking split -> output guard
    await run.release()                            # optional: free the slot and settle now, meter later
    await run.close()                              # release the slot, settle, meter, observe (idempotent)

`stream()` yields typed pieces, a union of small frozen dataclasses: `Thinking` and `AnswerText` as text
arrives, then exactly one `Finished` (finish reason, `Usage`, `Timings`). Fronts match on the piece type
and ignore types they do not know, so new kinds can be added without breaking them: `ToolCall` is one
(a whole call the model made, picked out of its text when the ask has tools; see app/tool_calls.py).
An ask may carry a `constraint` (JSON mode, a schema...) that the engine enforces token by token. Prompts are a union too (`ChatPrompt`, `TextPrompt`, `TokenPrompt`); continuing an answer from
text already produced (after a crash or a lost replica) is another prompt kind to add here.

`Run.stop()` may be called from any task: it leaves the queue (admit raises `GenerationStopped`) or
aborts the backend request (the stream ends with finish reason 'abort'). `Run.charge(usage)` adds model
work done for this run outside the stream (summaries), so it is settled and metered with it.
Refusals are `ApiError`s with the status and code the API returns; backend failures propagate as
`BackendError` / `BadGenerationRequest`.
"""
from __future__ import annotations

import asyncio
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from chatloom.app.traffic import reasoning
from chatloom.app.traffic.admission import INTERACTIVE, REASONING, Slot
from chatloom.app.core.errors import ApiError
from chatloom.app.core.settings import Settings
from chatloom.app.traffic.tiers import Tier
from chatloom.app.generation.tool_calls import ToolCall, ToolCallParser, ToolUse
from chatloom.app.traffic.control import Traffic
from chatloom.app.core.validation import check_fits, off_loop
from chatloom.serving import Backend, Constraint, GenerationRequest, Timings, Usage
from chatloom.store import User

REPLACEMENT_CHAR = "\ufffd"


# -- what a front asks for -------------------------------------------------------------------

@dataclass(frozen=True)
class Ask:
    """A generation as a front received it, before any check. None means the service's default."""

    user: User
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # sample from the k likeliest tokens only (None or 0: all of them)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    reasoning_effort: str | None = None  # low | medium | high: think first (chat prompts only)
    request_id: str | None = None  # default: a fresh id
    param: str = "messages"  # the request field that errors about the prompt name
    constraint: Constraint | None = None  # the answer must match this grammar
    tools: ToolUse | None = None  # tools the model may call: its calls come out as ToolCall pieces


@dataclass(frozen=True)
class Limits:
    """The ask after the caps: what the run may spend."""

    model: str
    tier: Tier
    max_tokens: int  # the answer's budget, thinking included
    temperature: float
    top_p: float
    effort: str | None


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict]  # [{"role", "content"}]
    # i12: the last message is an unfinished assistant turn to go on from (an interrupted answer resuming)
    continue_final: bool = False


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: list[int]


Prompt = ChatPrompt | TextPrompt | TokenPrompt


# -- what a run yields ----------------------------------------------------------------------

@dataclass(frozen=True)
class Thinking:
    """Reasoning text (from the <think> block), shown apart from the answer."""

    text: str


@dataclass(frozen=True)
class AnswerText:
    """Answer text that passed the output guard."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The last piece: why the answer ended (stop | length | abort | content_filter | tool_calls) and what
    it cost; with 'stop', the stop sequence that ended it where the backend says (None: an end token)."""

    finish_reason: str
    usage: Usage
    timings: Timings | None = None
    stop_sequence: str | None = None


Piece = Thinking | AnswerText | ToolCall | Finished


class GenerationStopped(Exception):
    """Run.stop() was called while the run waited for admission: nothing ran, nothing is owed."""


# -- the pipeline -----------------------------------------------------------------------------

class Pipeline:
    def __init__(self, backend: Backend, traffic: Traffic, settings: Settings) -> None:
        self.backend = backend
        self.traffic = traffic
        self.settings = settings

    @property
    def context_window(self) -> int:
        """Prompt plus answer tokens one request may use (the backend's, capped by the settings)."""
        window = self.backend.context_window
        return min(window, self.settings.context_window) if self.settings.context_window else window

    async def open(self, ask: Ask, moderate: str | None = None) -> "Run":
        """Apply the caps and moderate `moderate` (the user's own text); raises ApiError."""
        run = Run(self, ask, self._limits(ask))
        if moderate:
            await self.traffic.check_input(moderate, ask.param)
        return run

    def _limits(self, ask: Ask) -> Limits:
        s, traffic = self.settings, self.traffic
        model = self.backend.resolve_model(ask.model)
        tier = traffic.tier(ask.user)
        traffic.check_model(tier, model)
        window = self.context_window
        max_tokens = ask.max_tokens if ask.max_tokens is not None else min(s.default_max_tokens, window // 2)
        if max_tokens > s.max_tokens_limit:
            raise ApiError(400, f"max_tokens may be at most {s.max_tokens_limit}", "invalid_value", "max_tokens")
        if max_tokens >= window:
            raise ApiError(400, f"max_tokens must be below the context window ({window} tokens)",
                           "invalid_value", "max_tokens")
        max_tokens = traffic.cap_max_tokens(tier, max_tokens)
        effort = traffic.effort(ask.reasoning_effort)
        if effort is not None:  # room for the thinking on top of the answer, within the window
            max_tokens = min(max_tokens + reasoning.BUDGET_TOKENS[effort], (window + max_tokens) // 2)
        temperature = s.default_temperature if ask.temperature is None else ask.temperature
        top_p = s.default_top_p if ask.top_p is None else ask.top_p
        return Limits(model, tier, max_tokens, temperature, top_p, effort)


class Run:
    """One generation's trip; see the module docstring for the order of the calls."""

    def __init__(self, pipeline: Pipeline, ask: Ask, limits: Limits) -> None:
        self.pipeline = pipeline
        self.ask = ask
        self.limits = limits
        self.request_id = ask.request_id or f"gen-{uuid.uuid4().hex}"
        self.max_tokens = limits.max_tokens  # lowered when the prompt leaves less room
        self.usage = Usage()  # of the stream, so far (settled even if the run fails half-way)
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # the stop sequence that ended the answer (see Finished)
        self.timings: Timings | None = None
        self.stopped = False
        self._extra = Usage()
        self.summary_reserved = 0  # i12: quota reserved for this run's summaries (summary_admission.py)
        self._reservation = None
        self._slot: Slot | None = None
        self._queued: asyncio.Future | None = None
        self._prepared: tuple[Prompt, Prompt, int] | None = None  # (as given, as sent, its tokens)
        self._streaming = False
        self._released = False
        self._closed = False
        self.continuing = False  # taken over from a gateway that died (see adopt)

    @property
    def traffic(self) -> Traffic:
        return self.pipeline.traffic

    @property
    def reservation(self):
        """The quota reservation (a job record carries it, so whichever gateway ends the run settles it)."""
        return self._reservation

    def drop(self) -> None:
        """End here without settling: another gateway took the run over and settles it. Frees the slot."""
        self._closed = self._released = True
        if self._slot is not None:
            self._slot.release()

    def adopt(self, reservation) -> None:
        """Continue a run another gateway began: its quota reservation (already counted) becomes this
        run's, to be settled at close; admit() then does not reserve again."""
        self._reservation = reservation
        self.continuing = True

    # -- before the model ------------------------------------------------------------------
    def _prepare(self, prompt: Prompt) -> tuple[Prompt, int]:
        """The prompt as sent (thinking instructions added) and its exact token count."""
        if self._prepared is None or self._prepared[0] is not prompt:
            backend = self.pipeline.backend
            if isinstance(prompt, ChatPrompt):
                sent = prompt
                if self.limits.effort is not None:
                    sent = ChatPrompt(reasoning.with_instructions(prompt.messages, self.limits.effort),
                                      prompt.continue_final)
                tokens = backend.count_prompt_tokens(sent.messages)
            elif isinstance(prompt, TextPrompt):
                sent, tokens = prompt, backend.count_tokens(prompt.text)
            else:
                sent, tokens = prompt, len(prompt.token_ids)
            self._prepared = (prompt, sent, tokens)
        return self._prepared[1], self._prepared[2]

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's exact token count as sent, once measure(), reserve() or admit() has counted it."""
        return None if self._prepared is None else self._prepared[2]

    async def measure(self, prompt: Prompt) -> None:
        """Count the prompt now, in a worker thread when it is large (i12: not on the event loop);
        reserve() and admit() then reuse the count."""
        size = sum(len(m.get("content") or "") for m in prompt.messages) if isinstance(prompt, ChatPrompt) \
            else len(prompt.text) if isinstance(prompt, TextPrompt) else 0
        await off_loop(self._prepare, prompt, size=size)

    def _fit(self, prompt_tokens: int) -> None:
        window = self.pipeline.context_window
        if prompt_tokens >= window:
            raise ApiError(400, f"the prompt takes {prompt_tokens} tokens; the context window is {window} tokens "
                           "and the answer needs room too", "context_length_exceeded", self.ask.param)
        self.max_tokens = min(self.max_tokens, window - prompt_tokens)
        # i12: nor more KV cache than the engine's whole pool (it would wait in the queue forever).
        check_fits(prompt_tokens, self.max_tokens, window, self.pipeline.backend.kv_pool_tokens, self.ask.param)

    async def reserve(self, prompt: Prompt | int) -> None:
        """Refuse a prompt that can never fit (400), reserve its tokens plus max_tokens from the quota
        (429 past it), then refuse at once if the admission queue is full (503, the reservation given
        back). The user's own limit comes first: its 429 tells a client to slow down, where a 503 would
        only say the server is busy. Give the prompt itself, or (when it is assembled later) an
        estimate of its tokens."""
        tokens = prompt if isinstance(prompt, int) else self._prepare(prompt)[1]
        self._fit(tokens)
        reservation = await self.traffic.reserve(self.ask.user, self.limits.tier, tokens + self.max_tokens)
        if not self.continuing:  # a taken-over run was admitted on its first gateway
            try:
                self.refuse_if_full(tokens)
            except ApiError:
                await self.traffic.quotas.settle(reservation, 0)
                raise
        self._reservation = reservation

    async def admit(self, prompt: Prompt, on_position: Callable[[int], Awaitable[None]] | None = None) -> None:
        """Count the exact prompt, top the reservation up to it, and wait for room in the engine.
        `on_position` hears the place in the queue while it waits."""
        sent, tokens = self._prepare(prompt)
        self._fit(tokens)
        if self._reservation is None:
            self._reservation = await self.traffic.reserve(self.ask.user, self.limits.tier, tokens + self.max_tokens)
        elif not self.continuing:  # a continued answer's tokens were reserved when it began
            await self.traffic.extend(self._reservation, self.limits.tier, tokens + self.max_tokens + self.summary_reserved)
        if self.stopped:
            raise GenerationStopped
        # Joins the queue in this step (a full queue refuses here: 503, nothing made for the request).
        ticket = self.traffic.enqueue(self.limits.tier, tokens, self.kind, on_position)
        self._queued = asyncio.ensure_future(self.traffic.wait(ticket))
        try:
            self._slot = await self._queued
        except asyncio.CancelledError:
            self.traffic.admission.abandon(ticket)  # even if the wait was cancelled before it began
            # stop() cancelled the wait (not this task): the run ends as stopped, at no cost.
            if self.stopped and not asyncio.current_task().cancelling():
                raise GenerationStopped from None
            raise
        except BaseException:
            self.traffic.admission.abandon(ticket)
            raise
        finally:
            self._queued = None
        if self.stopped:
            raise GenerationStopped

    @property
    def kind(self) -> str:
        """The admission class: reasoning answers have their own share of the slots."""
        return REASONING if self.limits.effort is not None else INTERACTIVE

    def refuse_if_full(self, prompt_tokens: int) -> None:
        """503 at once if the admission queue could not take this run within its timeout."""
        self.traffic.refuse_if_full(self.limits.tier, prompt_tokens, self.kind)

    async def resume(self, prompt: Prompt, request_id: str) -> None:
        """Go on with the same answer from a longer prompt (the answer so far plus tool results), as a
        new backend request under `request_id`: the admission slot is kept, the tokens used so far are
        banked, and the reservation grows to cover the new round. The prompt repeats the previous one
        token for token, so the engine's prefix cache serves it and only the new turns are computed."""
        assert self._slot is not None, "admit() first"
        self._extra = self._extra + self.usage
        self.usage = Usage()
        self.request_id = request_id
        self.max_tokens = self.limits.max_tokens
        sent, tokens = self._prepare(prompt)
        self._fit(tokens)
        await self.traffic.extend(self._reservation, self.limits.tier,
                                  self._extra.total_tokens + tokens + self.max_tokens)

    # -- the model ------------------------------------------------------------------------------
    def _request(self) -> GenerationRequest:
        assert self._prepared is not None, "admit() first"
        sent, limits = self._prepared[1], self.limits
        req = GenerationRequest(model=limits.model, max_tokens=self.max_tokens, temperature=limits.temperature,
                                top_p=limits.top_p, top_k=self.ask.top_k or 0, seed=self.ask.seed, stop=list(self.ask.stop),
                                request_id=self.request_id, priority=-limits.tier.priority,  # low numbers run first
                                constraint=self.ask.constraint)
        if isinstance(sent, ChatPrompt):
            req.messages = sent.messages
            req.continue_final = sent.continue_final
        elif isinstance(sent, TextPrompt):
            req.prompt = sent.text
        else:
            req.prompt_token_ids = sent.token_ids
        return req

    async def stream(self) -> AsyncIterator[Piece]:
        """The answer as pieces; the last is Finished. Closing the iterator aborts the request."""
        backend = self.pipeline.backend
        guard = self.traffic.output_guard()
        splitter = reasoning.ThinkingSplitter() if self.limits.effort is not None else None
        tools = self.ask.tools
        calls = ToolCallParser(tools.names()) if tools is not None and tools.active else None
        aborted = False
        self._streaming = True
        async with aclosing(backend.stream(self._request())) as deltas:
            async for delta in deltas:
                self._slot.started()
                if self.stopped and not aborted:  # a stop that raced the request's start
                    backend.abort(self.request_id)
                    aborted = True
                self.usage = delta.usage
                cut = delta.finished and delta.finish_reason in ("length", "abort")
                text = _drop_cut_character(delta.text) if cut else delta.text
                if guard.verdict is None:
                    parts = splitter.push(text) if splitter else [("answer", text)] if text else []
                    if delta.finished and splitter:
                        parts += splitter.finish()
                    for kind, part in parts:
                        if kind == "thinking":
                            yield Thinking(part)
                        else:
                            for shown in await guard.push(part):
                                for out in _split_calls(calls, shown):
                                    yield out
                    if delta.finished and guard.verdict is None:
                        for shown in await guard.finish():
                            for out in _split_calls(calls, shown):
                                yield out
                        for out in _split_calls(calls, None):
                            yield out
                    if guard.verdict is not None and not aborted:
                        # Caught before the user saw it: stop the model now; the run ends as content_filter.
                        self.traffic.output_blocked(guard)
                        if not delta.finished:
                            backend.abort(self.request_id)
                            aborted = True
                if delta.finished:
                    self.finish_reason = "content_filter" if guard.verdict else (delta.finish_reason or "stop")
                    if calls is not None and calls.calls and self.finish_reason == "stop":
                        self.finish_reason = "tool_calls"
                    if self.finish_reason == "stop":
                        self.stop_sequence = delta.stop_sequence
                    self.timings = delta.metrics
                    yield Finished(self.finish_reason, delta.usage, delta.metrics, self.stop_sequence)

    def stop(self) -> None:
        """End the run early: leave the queue, or abort the backend request."""
        self.stopped = True
        if self._queued is not None:
            self._queued.cancel()
        if self._streaming:
            self.pipeline.backend.abort(self.request_id)

    # -- after ------------------------------------------------------------------------------------
    def charge(self, usage: Usage) -> None:
        """Model work for this run done outside its stream (summaries): settled and metered with it."""
        self._extra = self._extra + usage

    async def release(self) -> None:
        """The answer is over: free its concurrency slot and settle the quota with the tokens really used,
        so that the user's next request finds both free. close() does the rest: metering, a database
        write a front may leave until its response is complete. Charges must come before this."""
        if self._released:
            return
        self._released = True
        if self._slot is not None:
            self._slot.release()
        if self._reservation is not None:
            await self.traffic.quotas.settle(self._reservation, (self.usage + self._extra).total_tokens)

    async def close(self) -> None:
        """Release (if not done yet), meter the tokens used, observe latencies."""
        if self._closed:
            return
        self._closed = True
        await self.release()
        used = self.usage + self._extra
        if used.total_tokens:
            await self.traffic.meter.record(self.ask.user.id, self.limits.model, used)
        if self.usage.total_tokens:
            self.traffic.metrics.observe_request(self.timings, self.finish_reason or "abort", self.usage)


def _split_calls(parser: ToolCallParser | None, text: str | None) -> list[AnswerText | ToolCall]:
    """Answer text as pieces: plain text, or the tool calls found in it (text None: the answer ended)."""
    if parser is None:
        return [AnswerText(text)] if text else []
    parts = parser.finish() if text is None else parser.push(text)
    return [p if isinstance(p, ToolCall) else AnswerText(p) for p in parts if p]


def _drop_cut_character(text: str) -> str:
    """An answer cut (by max_tokens or a stop) in the middle of a multi-byte character ends in U+FFFD,
    the decoder's stand-in for the partial bytes: drop it rather than show a broken character."""
    return text.rstrip(REPLACEMENT_CHAR)
