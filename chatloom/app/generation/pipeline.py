"""One generation's trip through the product, written once and used by every API front.

Every answer, whether the conversation API's background job or an OpenAI-compatible request, goes
through the same stages, in this order:

    run = await pipeline.open(ask, moderate=text)  # caps: model allowed for the tier, max_tokens defaulted,
                                                   #   limited and capped, effort capped; input moderation
    await run.reserve(prompt or bound)             # 400 context_length_exceeded if it can never fit (before
                                                   #   any quota or queue), then the quota reservation (429),
                                                   #   503 queue_full at once if the queue could not take it in time
    await run.admit(prompt, on_position)           # exact prompt, within what was reserved; admission (503)
    async for piece in run.stream(): ...           # backend.stream -> thinking split -> output guard
    await run.release()                            # optional: free the slot and settle now, meter later
    await run.close()                              # release the slot, settle, meter, observe (idempotent)

`stream()` yields typed pieces, a union of small frozen dataclasses: `Thinking` and `AnswerText` as text
arrives, then exactly one `Finished` (finish reason, `Usage`, `Timings`). An ask of n > 1 choices is read
with `stream_choices()` instead: each piece comes as a `Choice` with its index, and each choice ends with
its own `Finished` (choice_stream.py holds one choice's state). Fronts match on the piece type and
ignore types they do not know: `ToolCall` is one (a whole call the model made, see tool_calls.py). An
ask may carry a `constraint` (JSON mode, a schema...) that the engine enforces token by token. Prompts
are a union too (`ChatPrompt`, `TextPrompt`, `TokenPrompt`).

`Run.stop()` may be called from any task: it leaves the queue (admit raises `GenerationStopped`) or
aborts the backend request (the stream ends with finish reason 'abort'). `Run.charge(usage)` adds model
work done for this run outside the stream (summaries), so it is settled and metered with it.
Refusals are `ApiError`s with the status and code the API returns; backend failures propagate as
`BackendError` / `BadGenerationRequest`.

Quota: `reserve()` is the run's only request to the quota store for the answer itself, and it comes
before any response is sent, so an over-quota run is always refused with a 429 and never fails once
its stream has begun. What it reserves is the run's `budget`: the prompt as it will be sent (or an
upper bound of it) plus max_tokens, and room for the tool rounds an answer may run (see `reserve`).
After that, admit() and resume() fit each round into what is left of the budget (lowering the round's
max_tokens) instead of asking for more; a later round that no longer fits raises `BudgetSpent` and
the answer ends as 'length'. Summaries have an allowance of their own (summary_admission.py).
close() settles the reservation down to the tokens really used. docs/quotas.md states the rule.
A batch ask (`Ask.batch`) runs in the admission queue's batch class; its tokens count against the day's
quota only, at `[batch] quota_discount` (`Run.charged`). Metering records the tokens really used.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable

from chatloom.app.traffic import batch_class, reasoning
from chatloom.app.traffic.admission import BATCH, INTERACTIVE, REASONING, Slot
from chatloom.app.core.errors import ApiError
from chatloom.app.traffic.quotas import QuotaExceeded
from chatloom.settings import Settings
from chatloom.app.generation.caps import caps
from chatloom.app.generation.choice_stream import ChoiceStream
from chatloom.app.generation.embedding import Embedder
from chatloom.app.generation.run_types import (AnswerText, Ask, BudgetSpent, ChatPrompt, Choice, Finished,
                                               GenerationStopped, Limits, Piece, Prompt, PromptLogprobs, TextPrompt,
                                               Thinking, TokenPrompt)
from chatloom.app.generation.tool_calls import ToolCall, ToolCallParser
from chatloom.app.traffic.control import Traffic
from chatloom.app.core.validation import check_fits, off_loop
from chatloom.serving import Backend, BackendNotReady, GenerationRequest, Timings, Usage

# The trip's values live in run_types.py; fronts import them from here with the pipeline.
__all__ = ["Pipeline", "Run", "Ask", "Limits", "ChatPrompt", "TextPrompt", "TokenPrompt", "Prompt", "Thinking",
           "AnswerText", "PromptLogprobs", "Finished", "Piece", "Choice", "ToolCall", "GenerationStopped",
           "BudgetSpent"]


# -- the pipeline -----------------------------------------------------------------------------

class Pipeline:
    def __init__(self, backend: Backend, traffic: Traffic, settings: Settings) -> None:
        self.backend = backend
        self.traffic = traffic
        self.settings = settings
        self.embeddings = Embedder(backend, traffic, settings)  # the embed path (embedding.py)

    @property
    def context_window(self) -> int:
        """Prompt plus answer tokens one request may use (the backend's, capped by the settings)."""
        window = self.backend.context_window
        return min(window, self.settings.engine.context_window) if self.settings.engine.context_window else window

    async def open(self, ask: Ask, moderate: str | None = None) -> "Run":
        """Apply the caps and moderate `moderate` (the user's own text); raises ApiError, and BackendNotReady
        (503 with Retry-After) while the model loads or the router starts, before anything is stored: the
        caps read the backend's context window, which is not known yet."""
        if not self.backend.ready:
            raise BackendNotReady(self.backend.load_error or "the model is loading; try again shortly")
        run = Run(self, ask, caps(ask, self.backend, self.traffic, self.settings, self.context_window))
        if moderate:
            await self.traffic.check_input(moderate, ask.param)
        return run


class Run:
    """One generation's trip; see the module docstring for the order of the calls."""

    def __init__(self, pipeline: Pipeline, ask: Ask, limits: Limits) -> None:
        self.pipeline, self.ask, self.limits = pipeline, ask, limits
        self.request_id = ask.request_id or f"gen-{uuid.uuid4().hex}"
        self.max_tokens = limits.max_tokens  # lowered when the prompt leaves less room
        self.usage = Usage()  # of the stream, so far (settled even if the run fails half-way), every choice's
        self._choice_usage: dict[int, Usage] = {}
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # the stop sequence that ended the answer (see Finished)
        self.timings: Timings | None = None
        self.stopped = False
        self._extra = Usage()  # charged from outside the stream (summaries)
        self._rounds = Usage()  # of the rounds before this one (tool calls): paid from the budget
        self.budget: int | None = None  # tokens reserved for the answer itself, every round included
        self.summary_allowance = 0  # tokens reserved for this run's summaries, not yet taken (summary_admission.py)
        self._reservation = None
        self._slot: Slot | None = None
        self._queued: asyncio.Future | None = None
        self._prepared: tuple[Prompt, Prompt, int] | None = None  # (as given, as sent, its tokens)
        self._streaming = self._released = self._closed = False
        self.continuing = False  # taken over from a gateway that died (see adopt)
        self.resume_of, self.keeps_kv = None, False  # the tool round resumed; keep this one's KV (tool_kv.py)
        self.gave_way = False  # a batch run stopped for interactive work (see give_way)
        self._opened = time.monotonic()  # the class's time-to-first-token target counts from here

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
        run's, to be settled at close; admit() then neither reserves again nor fits to a budget."""
        self._reservation = reservation
        self.continuing = True

    def prompt_tokens(self, prompt: Prompt) -> int:
        """The prompt's tokens as it will be sent (thinking instructions included); reserve() and admit()
        reuse the count for the same prompt object."""
        return self._prepare(prompt)[1]

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
    def counted_prompt_tokens(self) -> int | None:
        """The last prompt's exact token count as sent, once measure(), reserve() or admit() has counted it."""
        return None if self._prepared is None else self._prepared[2]

    async def measure(self, prompt: Prompt) -> None:
        """Count the prompt now, in a worker thread when it is large (not on the event loop);
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
        # nor more KV cache than the engine's whole pool (it would wait in the queue forever).
        check_fits(prompt_tokens, self.max_tokens, window, self.pipeline.backend.kv_pool_tokens, self.ask.param,
                   self.ask.n)

    async def reserve(self, prompt: Prompt | int, extra_rounds: int = 0, summaries: int = 0) -> None:
        """Refuse a prompt that can never fit (400), reserve the run's budget from the quota (429 past it),
        then refuse at once if the admission queue is full (503, the reservation given back). The user's
        own limit comes first: its 429 tells a client to slow down, where a 503 would only say the server
        is busy.

        Give the prompt itself, or (when part of it is written later, e.g. a summary) an upper bound of
        its tokens: every later round must fit in what is reserved here. The budget is the first round
        (prompt + max_tokens) and, for an answer that may call tools, `extra_rounds` more at twice that
        each: a later round reads the earlier prompt again, what the model wrote and the tools' results,
        then answers. All rounds share the budget (capped so that it fits the tier's per-minute limit).
        `summaries`: tokens for summaries the run writes before its answer, reserved with the budget when
        the quota has room for both; when it has room for the budget alone, the summaries go without (each
        then asks the quota itself and is skipped if refused: summary_admission.py)."""
        tokens = prompt if isinstance(prompt, int) else self._prepare(prompt)[1]
        self._fit(tokens)
        first = tokens + self.max_tokens * self.ask.n  # the choices share the prompt, not the answer
        tier = self.limits.tier
        budget = max(first, min(first * (1 + 2 * max(0, extra_rounds)), tier.tokens_per_minute))
        if self.ask.batch:
            batch_class.check_size(self.charged(budget), tier, self.ask.param)
        reservation = None
        if summaries:
            try:  # straight to the store: a miss here is no refusal (no 429 counted)
                reservation = await self.traffic.quotas.reserve(self.ask.user.id, tier,
                                                                self.charged(budget + summaries), self.ask.batch)
            except QuotaExceeded:
                summaries = 0
        if reservation is None:
            reservation = await self.traffic.reserve(self.ask.user, tier, self.charged(budget), self.ask.batch)
        if not self.continuing:  # a taken-over run was admitted on its first gateway
            try:
                self.refuse_if_full(tokens)
            except ApiError:
                await self.traffic.quotas.settle(reservation, 0)
                raise
        self._reservation = reservation
        self.budget = budget
        self.summary_allowance = summaries

    async def admit(self, prompt: Prompt, on_position: Callable[[int], Awaitable[None]] | None = None) -> None:
        """Count the exact prompt, fit the round into the budget reserved before, and wait for room in the
        engine. `on_position` hears the place in the queue while it waits."""
        sent, tokens = self._prepare(prompt)
        self._fit(tokens)
        if self._reservation is None:
            self.budget = tokens + self.max_tokens * self.ask.n
            self._reservation = await self.traffic.reserve(self.ask.user, self.limits.tier,
                                                           self.charged(self.budget), self.ask.batch)
        elif not self.continuing:  # a continued answer's tokens were reserved when it began
            self._within_budget(tokens)
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
        if self.ask.batch:
            self._slot.on_yield = self.give_way
        if self.stopped:
            raise batch_class.gave_way() if self.gave_way else GenerationStopped

    def give_way(self) -> None:
        """A batch run's slot is needed for interactive work: stop, end with batch_class.gave_way, charge nothing."""
        self.gave_way = True
        self.stop()

    def _within_budget(self, prompt_tokens: int) -> None:
        """Lower this round's max_tokens to what the budget has left after its prompt; BudgetSpent when
        nothing is left. Never asks the quota for more: the answer may already be streaming."""
        if self.budget is None:
            return
        room = (self.budget - self._rounds.total_tokens - prompt_tokens) // self.ask.n
        if room < 1:
            raise BudgetSpent
        self.max_tokens = min(self.max_tokens, room)

    @property
    def kind(self) -> str:
        """The admission class: reasoning answers have their own share of the slots; batch is below all."""
        if self.ask.batch:
            return BATCH
        return REASONING if self.limits.effort is not None else INTERACTIVE

    def charged(self, tokens: int) -> int:
        """What `tokens` of this run count against the quota (batch runs: at the discount)."""
        return batch_class.charged(tokens, self.pipeline.settings.batch) if self.ask.batch else tokens

    def refuse_if_full(self, prompt_tokens: int) -> None:
        """503 at once if the admission queue could not take this run within its timeout."""
        self.traffic.refuse_if_full(self.limits.tier, prompt_tokens, self.kind)

    async def resume(self, prompt: Prompt, request_id: str) -> None:
        """Go on with the same answer from a longer prompt (the answer so far plus tool results), as a
        new backend request under `request_id`: the admission slot is kept, the tokens used so far are
        banked, and the round gets what the budget has left (BudgetSpent when that is nothing). The
        prompt repeats the previous one token for token, so the engine's prefix cache serves it and only
        the new turns are computed."""
        assert self._slot is not None, "admit() first"
        self._rounds = self._rounds + self.usage
        self.usage = Usage()
        self.resume_of, self.keeps_kv, self.request_id = self.request_id, False, request_id
        self.max_tokens = self.limits.max_tokens
        sent, tokens = self._prepare(prompt)
        self._fit(tokens)
        self._within_budget(tokens)

    # -- the model ------------------------------------------------------------------------------
    def _request(self) -> GenerationRequest:
        assert self._prepared is not None, "admit() first"
        sent, limits, ask = self._prepared[1], self.limits, self.ask
        req = GenerationRequest(model=limits.model, max_tokens=self.max_tokens, temperature=limits.temperature,
                                top_p=limits.top_p, top_k=ask.top_k or 0, seed=ask.seed, stop=list(ask.stop),
                                request_id=self.request_id,  # low priority numbers run first; batch is last
                                priority=self.pipeline.settings.batch.engine_priority if ask.batch
                                else -limits.tier.priority,
                                constraint=ask.constraint, n=ask.n, logprobs=ask.logprobs,
                                prompt_logprobs=ask.prompt_logprobs, resume_of=self.resume_of,
                                keep_kv=self.keeps_kv, ttft_target_s=self._ttft_left())
        if isinstance(sent, ChatPrompt):
            req.messages = sent.messages
            req.continue_final = sent.continue_final
        elif isinstance(sent, TextPrompt):
            req.prompt = sent.text
        else:
            req.prompt_token_ids = sent.token_ids
        return req

    def _ttft_left(self) -> float | None:
        """What the class's time-to-first-token target leaves after the wait so far (the first round's
        only: a later round's first token is not the answer's)."""
        if self._rounds.total_tokens or self.resume_of is not None:
            return None
        target = self.traffic.metrics.slo_for(self.traffic.slo_class(self.limits.tier, self.kind)).ttft_s
        return None if target is None else target - (time.monotonic() - self._opened)

    async def stream(self) -> AsyncIterator[Piece]:
        """The answer as pieces; the last is Finished. Closing the iterator aborts the request."""
        async with aclosing(self.stream_choices()) as choices:
            async for choice in choices:
                yield choice.piece

    async def stream_choices(self) -> AsyncIterator[Choice]:
        """The answer's pieces by choice (an ask of n > 1), each ending with its own Finished; closing aborts."""
        backend, ask = self.pipeline.backend, self.ask
        choices: dict[int, ChoiceStream] = {}
        aborted = False
        if self.gave_way:
            raise batch_class.gave_way()
        self._streaming = True
        async with aclosing(backend.stream(self._request())) as deltas:
            async for delta in deltas:
                self._slot.started(shown=False)  # the output check may hold the first pieces back
                if self.stopped and not aborted:  # a stop that raced the request's start
                    backend.abort(self.request_id)
                    aborted = True
                self._count(delta)
                choice = choices.get(delta.index)
                if choice is None:
                    choice = choices[delta.index] = self._choice_stream()
                for piece in await choice.feed(delta):
                    yield Choice(delta.index, piece)
                    self._slot.shown()  # the front has sent it on: batch work need not wait for this run now
                if choice.guard.verdict is not None and not choice.blocked_reported:
                    # Caught before the user saw it: the choice ends as content_filter. A lone answer stops
                    # the model now; with several, the others go on (the engine stops requests, not choices).
                    choice.blocked_reported = True
                    self.traffic.output_blocked(choice.guard)
                    if not delta.finished and ask.n == 1 and not aborted:
                        backend.abort(self.request_id)
                        aborted = True
                if delta.finished and self.gave_way and delta.finish_reason == "abort":
                    raise batch_class.gave_way()
                if delta.finished:
                    self.finish_reason = choice.finish_reason(delta)
                    self.stop_sequence = delta.stop_sequence if self.finish_reason == "stop" else None
                    self.timings = delta.metrics
                    yield Choice(delta.index, Finished(self.finish_reason, self._choice_usage[delta.index],
                                                       delta.metrics, self.stop_sequence))

    def _choice_stream(self) -> ChoiceStream:
        tools = self.ask.tools
        return ChoiceStream(self.traffic.output_guard(),
                            reasoning.ThinkingSplitter() if self.limits.effort is not None else None,
                            ToolCallParser(tools.names()) if tools is not None and tools.active else None)

    def _count(self, delta) -> None:
        """The run's usage after `delta`: the prompt once, every choice's answer tokens."""
        self._choice_usage[delta.index] = delta.usage
        first = self._choice_usage.get(0, delta.usage)
        self.usage = Usage(first.prompt_tokens, sum(u.completion_tokens for u in self._choice_usage.values()),
                           first.cached_tokens)

    def stop(self) -> None:
        """End the run early: leave the queue, or abort the backend request."""
        self.stopped = True
        if self._queued is not None:
            self._queued.cancel()
        if self._streaming:
            self.pipeline.backend.abort(self.request_id)

    # -- after ------------------------------------------------------------------------------------
    @property
    def used(self) -> Usage:
        """Everything this run has cost so far: every round, and the work charged to it."""
        return self.usage + self._rounds + self._extra

    @property
    def answer_usage(self) -> Usage:  # every round's stream (tool calls), not the work charged to it
        return self.usage + self._rounds

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
            used = 0 if self.gave_way else self.charged(self.traffic.charged_tokens(self.used))
            await self.traffic.quotas.settle(self._reservation, used)

    async def close(self, metered: bool = False) -> None:
        """Release (if not done yet), meter the tokens used (unless `metered`: the caller wrote them), observe."""
        if self._closed:
            return
        self._closed = True
        await self.release()
        used = self.used
        if used.total_tokens and not self.gave_way and not metered:
            await self.traffic.meter.record(self.ask.user.id, self.limits.model, used)
        if self.usage.total_tokens:
            self.traffic.metrics.observe_request(self.timings, self.finish_reason or "abort", self.usage,
                                                 self.traffic.slo_class(self.limits.tier, self.kind))
