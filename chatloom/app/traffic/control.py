"""Traffic control, wired together: tiers, token quotas, the admission queue, moderation, metering
and metrics, as one object the routes and the conversation service share.

The helpers here turn each component's refusal into the API's answer: a quota refusal is a 429
with Retry-After, OpenAI's code and the x-ratelimit-* headers; a flagged message a 400 naming the
category; a queue timeout a 503 with Retry-After. `RateLimitHeaders` puts the x-ratelimit-* headers
on every signed-in response. A generation's use of all this is written once, in `pipeline.py`.
"""
from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Awaitable, Callable

from chatloom.app.traffic.admission import INTERACTIVE, AdmissionQueue, QueueTimeout, Slot, Ticket
from chatloom.app.core.errors import ApiError
from chatloom.app.traffic.degrade import APPLIED, STEPS, DegradeLadder, RecentMax, Signals
from chatloom.app.traffic.metrics import Metrics, Slo
from chatloom.app.traffic.moderation import LexiconModerator, ModerationUnavailable, Moderator, NoModerator, OutputGuard
from chatloom.app.traffic.remote_moderation import RemoteModerator
from chatloom.app.traffic.quotas import MemoryQuotaStore, QuotaExceeded, QuotaStore, Reservation
from chatloom.app.traffic.reasoning import EFFORTS, cap_effort
from chatloom.settings import Settings
from chatloom.app.traffic.tiers import Tier, TierTable
from chatloom.app.traffic.metering import Meter
from chatloom.serving import Backend, Usage
from chatloom.store import Database, User

log = logging.getLogger(__name__)


@dataclass
class Traffic:
    settings: Settings
    tiers: TierTable
    quotas: QuotaStore
    admission: AdmissionQueue
    moderator: Moderator
    metrics: Metrics
    meter: Meter
    reasoning_max_effort: str = "high"
    ladder: DegradeLadder | None = None  # degrade before refusing; None: never
    arrivals: int = 0  # requests that came to the admission queue (each tool round too): the autoscaler's input
    recent_wait: RecentMax | None = None  # the longest admission-queue wait of the last seconds

    # -- degrade before refusing --------------------------------------------------------
    def _step(self, step: str) -> bool:
        """Whether the ladder has taken `step` now; marks it applied to the request being handled."""
        if self.ladder is None or not self.ladder.active(step):
            return False
        APPLIED.set((*APPLIED.get(), step))
        self.metrics.degraded_requests.labels(step).inc()
        return True

    def degrade(self, tier: Tier, model: str, max_tokens: int, effort: str | None) -> tuple[str, int, str | None]:
        """The request's model, answer cap and reasoning effort after the degrade steps in force."""
        if self.ladder is None:
            return model, max_tokens, effort
        self.ladder.update()
        d = self.settings.degrade
        if effort is not None and EFFORTS.index(effort) > EFFORTS.index(d.effort_cap) and self._step("effort"):
            effort = d.effort_cap
        if d.small_model and model != d.small_model and tier.name in d.small_model_tiers \
                and tier.allows_model(d.small_model) and self._step("small_model"):
            model = d.small_model
        if max_tokens > d.max_tokens_cap and tier.name in d.max_tokens_tiers and self._step("max_tokens"):
            max_tokens = d.max_tokens_cap
        return model, max_tokens, effort

    async def follow_load(self) -> None:
        """Read the ladder's signals every check interval until cancelled, so its steps come off once the
        load has fallen even when no request arrives to take a reading (/metrics and /admin/ops show it)."""
        if self.ladder is None:
            return
        while True:
            await asyncio.sleep(max(0.1, self.settings.degrade.check_interval_s))
            try:
                self.ladder.update()
            except Exception as exc:  # a backend between states: the next reading decides
                log.debug("degrade ladder not updated: %s", exc)

    def size_admission(self, replicas: int) -> None:
        """`replicas` local replicas serve now: admit as many generations at once as they run together
        (engine.max_num_seqs each), unless traffic.admission_max_running fixes the number."""
        if self.settings.traffic.admission_max_running is not None:
            return
        a = self.admission
        a.max_running = max(1, replicas) * self.settings.engine.max_num_seqs  # waiting requests fill new slots
        if a.fleet is not None:  # other gateways count this one's slots in their shares
            a.fleet.local_max_running = a.max_running

    def slo_class(self, tier: Tier, kind: str) -> str:
        return slo_class(tier, kind)

    # -- tiers ------------------------------------------------------------------------
    def tier(self, user: User) -> Tier:
        return self.tiers.for_user(user.tier)

    def check_model(self, tier: Tier, model: str) -> None:
        if not tier.allows_model(model):
            raise ApiError(403, f"the {tier.name} tier may not use the model {model!r}", "model_not_allowed", "model")

    def cap_max_tokens(self, tier: Tier, max_tokens: int) -> int:
        """Answers of a tier are at most tier.max_tokens long, whatever the request asks."""
        return min(max_tokens, tier.max_tokens)

    def effort(self, requested: str | None) -> str | None:
        return None if requested is None else cap_effort(requested, self.reasoning_max_effort)

    # -- moderation ---------------------------------------------------------------------
    async def check_input(self, text: str, param: str = "text") -> None:
        try:
            verdict = await self.moderator.check_input(text)
        except ModerationUnavailable as exc:
            raise ApiError(503, f"the message could not be checked: {exc}", "moderation_unavailable",
                           headers={"Retry-After": "5"}) from None
        if verdict is not None:
            self.metrics.moderation_blocks.labels("input", verdict.category).inc()
            raise ApiError(400, f"the message was flagged by moderation ({verdict.category}) and not sent",
                           "content_policy_violation", param)

    def output_guard(self) -> OutputGuard:
        return OutputGuard(self.moderator, self.settings.moderation.holdback_tokens)

    def output_blocked(self, guard: OutputGuard) -> None:
        if guard.verdict is not None:
            self.metrics.moderation_blocks.labels("output", guard.verdict.category).inc()

    # -- quotas ------------------------------------------------------------------------
    def _refusal(self, exc: QuotaExceeded) -> ApiError:
        self.metrics.rate_limited.labels(exc.code).inc()
        retry = max(1, math.ceil(exc.retry_after))
        return ApiError(429, str(exc), exc.code, headers={"Retry-After": str(retry), **exc.state.headers()})

    async def reserve(self, user: User, tier: Tier, tokens: int, batch: bool = False) -> Reservation:
        try:
            return await self.quotas.reserve(user.id, tier, tokens, batch)
        except QuotaExceeded as exc:
            raise self._refusal(exc) from None

    async def extend(self, reservation: Reservation, tier: Tier, tokens: int) -> None:
        try:
            await self.quotas.extend(reservation, tier, tokens)
        except QuotaExceeded as exc:
            raise self._refusal(exc) from None

    def charged_tokens(self, usage: Usage) -> int:
        """What a run's tokens cost the quota: prompt tokens served from the prefix cache count at
        the discounted rate (traffic.cached_input_discount), everything else in full."""
        discount = self.settings.traffic.cached_input_discount
        return usage.total_tokens - math.floor(usage.cached_tokens * discount)

    async def headers(self, user: User) -> dict[str, str]:
        return (await self.quotas.state(user.id, self.tier(user))).headers()

    # -- admission ----------------------------------------------------------------------
    async def admit(self, tier: Tier, prompt_tokens: int, kind: str = INTERACTIVE,
                    on_position: Callable[[int], Awaitable[None]] | None = None) -> Slot:
        return await self.wait(self.enqueue(tier, prompt_tokens, kind, on_position))

    def enqueue(self, tier: Tier, prompt_tokens: int, kind: str = INTERACTIVE,
                on_position: Callable[[int], Awaitable[None]] | None = None) -> Ticket:
        """Join the admission queue now (503 at once if it could not take the request in time)."""
        self.arrivals += 1
        try:
            return self.admission.enqueue(tier, prompt_tokens, kind, on_position)
        except QueueTimeout as exc:
            raise self._busy(exc) from None

    async def wait(self, ticket: Ticket) -> Slot:
        """The slot of an enqueued request (503 after the queue timeout)."""
        try:
            return await self.admission.wait(ticket)
        except QueueTimeout as exc:
            raise self._busy(exc) from None

    def refuse_if_full(self, tier: Tier, prompt_tokens: int, kind: str = INTERACTIVE) -> None:
        """503 now (no await, nothing queued) if the queue could not take this request in time."""
        try:
            self.admission.refuse_if_full(tier, prompt_tokens, kind)
        except QueueTimeout as exc:
            raise self._busy(exc) from None

    def _busy(self, exc: QueueTimeout) -> ApiError:
        self.metrics.queue_timeouts.inc()
        return ApiError(503, str(exc), exc.code, headers={"Retry-After": str(exc.retry_after)})


def build_moderator(settings: Settings) -> Moderator:
    name = settings.moderation.mode
    if name in ("off", "none", ""):
        return NoModerator()
    if name == "lexicon":
        return LexiconModerator()
    if name == "openai":
        return RemoteModerator.from_settings(settings)
    raise ValueError(f"unknown moderation {name!r} (use 'lexicon', 'openai' or 'off')")


def slo_class(tier: Tier, kind: str) -> str:
    """The traffic class a request is measured in: 'interactive:<tier>', 'reasoning' or 'batch'."""
    return f"{kind}:{tier.name}" if kind == INTERACTIVE else kind


def build_traffic(settings: Settings, backend: Backend, db: Database) -> Traffic:
    if settings.traffic.reasoning_max_effort not in EFFORTS:
        raise ValueError(f"reasoning_max_effort must be one of {', '.join(EFFORTS)}")
    metrics = Metrics(backend.stats, lambda: backend.default_model if backend.model_ids else "unknown",
                      Slo(settings.traffic.slo_ttft_s, settings.traffic.slo_tpot_s),
                      {name: Slo(t.ttft_s, t.tpot_s) for name, t in settings.traffic.slo_classes.items()})
    recent_wait = RecentMax()

    def on_wait(ticket: Ticket, waited: float, admitted: bool) -> None:
        metrics.queue_wait.labels(ticket.tier.name, ticket.kind).observe(waited)
        recent_wait.add(waited)

    admission = AdmissionQueue(backend.has_room, settings.traffic.admission_max_running or settings.engine.max_num_seqs,
                               settings.traffic.queue_max_wait_s, settings.traffic.reasoning_share, on_wait=on_wait,
                               batch_share=settings.batch.slot_share, batch_busy_slots=settings.batch.busy_slots,
                               ttft_target=lambda tier, kind: metrics.slo_for(slo_class(tier, kind)).ttft_s)
    metrics.queue_waiting.set_function(lambda: admission.waiting)
    metrics.queue_running.set_function(lambda: admission.running)

    def signals() -> Signals:
        kv = backend.stats().kv_cache_usage_perc if backend.ready else None
        return Signals(max(admission.oldest_wait_s(), recent_wait.value()), kv or 0.0)

    ladder = DegradeLadder(settings.degrade, settings.traffic.queue_max_wait_s, signals) if settings.degrade.enabled else None
    if ladder is not None:
        metrics.degrade_level.set_function(lambda: ladder.level)

        def before_refusing(expected_s: float, joining: bool) -> bool:
            """Degrade before refusing: a burst faster than the readings takes the next step, not a 503
            (once per request: as it joins the queue; its early check only sees whether a step is left)."""
            if not joining:
                return ladder.level < len(STEPS)
            recent_wait.add(expected_s)  # the wait it would have had: the readings keep the steps while it lasts
            return ladder.step_up()

        admission.before_refusing = before_refusing
    return Traffic(settings=settings, tiers=TierTable.load(settings.traffic.tiers_file, default=settings.traffic.default_tier),
                   quotas=MemoryQuotaStore(), admission=admission, moderator=build_moderator(settings),
                   metrics=metrics, meter=Meter(db, flush_gap_s=settings.traffic.metering_flush_gap_ms / 1e3),
                   reasoning_max_effort=settings.traffic.reasoning_max_effort,
                   ladder=ladder, recent_wait=recent_wait)


def check_degrade_model(settings: Settings, backend: Backend) -> None:
    """The small model of the degrade ladder must be one the backend serves; raises ValueError."""
    small = settings.degrade.small_model
    if settings.degrade.enabled and small and backend.model_ids and small not in backend.model_ids:
        raise ValueError(f"degrade.small_model {small!r} is not served (served: {', '.join(backend.model_ids)})")


class RateLimitHeaders:
    """ASGI middleware: every response to a signed-in caller carries x-ratelimit-* headers.
    (Pure ASGI, not BaseHTTPMiddleware, so streamed answers are not buffered.)"""

    def __init__(self, app, traffic: Callable[[], Traffic]) -> None:
        self.app = app
        self.traffic = traffic

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                user = scope.get("state", {}).get("user")
                traffic = self.traffic()
                headers = list(message.get("headers", []))
                if APPLIED.get():
                    headers.append((b"x-chatloom-degraded", ",".join(APPLIED.get()).encode()))
                    message = {**message, "headers": headers}
                if user is not None and not any(k == b"x-ratelimit-limit-tokens" for k, _ in headers):
                    try:
                        figures = await traffic.headers(user)
                    except Exception:  # a shared quota store out of reach: the answer itself says so, or not
                        figures = {}
                    headers += [(k.encode(), v.encode()) for k, v in figures.items()]
                    message = {**message, "headers": headers}
            await send(message)

        reset = APPLIED.set(())  # the degrade steps this request meets, for its header
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            APPLIED.reset(reset)

