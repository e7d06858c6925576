"""Token quotas: reserve at admission, settle with the real count at the end.

A request reserves prompt tokens + max_tokens before any model work; the reservation counts
against the user's per-minute and per-day budgets at once, so any number of concurrent requests
can never be granted more than the limit. When the generation ends (finished, stopped, failed)
the reservation is settled to the tokens really used, giving back the rest.

A batch reservation (a Batch API request) counts against the day's tokens only: the batch class
already runs only on capacity interactive traffic leaves idle, `batch.concurrency` at a time, so it
takes none of the user's requests per minute, tokens per minute or concurrent generations, and a
user's chat is never refused because their own batch is running.

`QuotaStore` is the interface (async, so a store may live in another server); `MemoryQuotaStore`
keeps the counters in this process; `chatloom.app.state.redis_quotas.RedisQuotaStore` keeps them
in Redis, one Lua script per call, so the check-and-reserve stays atomic across any number of gateways.
Both refuse with the same messages (`refusal`).
"""
from __future__ import annotations

import abc
import functools
import inspect
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from chatloom.app.traffic.tiers import Tier

MINUTE = 60.0


class QuotaExceeded(Exception):
    """Over a limit: `code` is OpenAI's (rate_limit_exceeded, or insufficient_quota for the day)."""

    def __init__(self, message: str, code: str, retry_after: float, state: "QuotaState") -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after
        self.state = state


@dataclass
class QuotaState:
    """What the x-ratelimit-* headers report."""

    limit_requests: int
    remaining_requests: int
    reset_requests_s: float
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_s: float
    day_used: int = 0  # what the day's quota counts so far (running reservations in full)

    def headers(self) -> dict[str, str]:
        return {"x-ratelimit-limit-requests": str(self.limit_requests),
                "x-ratelimit-remaining-requests": str(max(0, self.remaining_requests)),
                "x-ratelimit-reset-requests": duration(self.reset_requests_s),
                "x-ratelimit-limit-tokens": str(self.limit_tokens),
                "x-ratelimit-remaining-tokens": str(max(0, self.remaining_tokens)),
                "x-ratelimit-reset-tokens": duration(self.reset_tokens_s)}


def duration(seconds: float) -> str:
    """OpenAI's reset format: '0s', '12s', '6m0s', '1h2m3s'."""
    s = max(0, math.ceil(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m}m{s}s"
    if m:
        return f"{m}m{s}s"
    return f"{s}s"


@dataclass
class Reservation:
    user_id: str
    tokens: int
    created: float
    day: str
    settled: bool = False
    batch: bool = False  # counted against the day only
    _entry: list = field(default_factory=list, repr=False)  # [time, tokens, in the window] (memory store)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # names it in a shared store


class QuotaStore(abc.ABC):
    @abc.abstractmethod
    async def reserve(self, user_id: str, tier: Tier, tokens: int, batch: bool = False) -> Reservation:
        """Count `tokens` against the user's budgets now (`batch`: the day's only), or raise QuotaExceeded."""

    @abc.abstractmethod
    async def extend(self, reservation: Reservation, tier: Tier, tokens: int) -> None:
        """Grow a reservation to `tokens` (the exact prompt turned out larger), or raise QuotaExceeded."""

    @abc.abstractmethod
    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Replace the reservation by the tokens really used; ends the request's concurrency slot."""

    @abc.abstractmethod
    async def state(self, user_id: str, tier: Tier) -> QuotaState: ...


@dataclass
class _UserCounters:
    minute: deque = field(default_factory=deque)  # [time, tokens, in the window] entries, oldest first
    # The sum of the window's tokens, kept as entries come, change and leave: a user with thousands of
    # requests in the last minute is checked without adding them all up each time.
    minute_tokens: int = 0
    requests: deque = field(default_factory=deque)  # request start times
    day: str = ""
    day_tokens: int = 0
    active: int = 0


# Why a request is refused, in the order the checks run.
TOO_BIG, PER_DAY, CONCURRENCY, REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE = range(1, 6)


def refusal_kind(tier: Tier, tokens: int, new_request: bool, minute_used: int, day_used: int, active: int,
                 requests: int, batch: bool = False) -> int | None:
    """Which limit `tokens` more would break (None: none). Shared by every store, so all refuse alike."""
    if tokens > tier.tokens_per_minute:
        return TOO_BIG
    if day_used + tokens > tier.tokens_per_day:
        return PER_DAY
    if batch:
        return None
    if new_request and active >= tier.max_concurrent:
        return CONCURRENCY
    if new_request and requests >= tier.requests_per_minute:
        return REQUESTS_PER_MINUTE
    if minute_used + tokens > tier.tokens_per_minute:
        return TOKENS_PER_MINUTE
    return None


def refusal(kind: int, tier: Tier, tokens: int, minute_used: int, day_used: int, now: float,
            oldest_request: float, wait_s: float, state: QuotaState) -> QuotaExceeded:
    """The refusal for `kind`: its message, OpenAI's code and when to retry."""
    if kind == TOO_BIG:
        return QuotaExceeded(f"this request needs {tokens} tokens (prompt + max_tokens), more than the "
                             f"{tier.name} tier's {tier.tokens_per_minute} tokens per minute; lower "
                             "max_tokens or shorten the prompt", "rate_limit_exceeded", MINUTE, state)
    if kind == PER_DAY:
        return QuotaExceeded(f"daily token quota of the {tier.name} tier used up ({day_used} of "
                             f"{tier.tokens_per_day} tokens today, this request needs {tokens})",
                             "insufficient_quota", _seconds_to_midnight(now), state)
    if kind == CONCURRENCY:
        return QuotaExceeded(f"the {tier.name} tier runs at most {tier.max_concurrent} generations at "
                             "once; wait for one to finish", "rate_limit_exceeded", 1.0, state)
    if kind == REQUESTS_PER_MINUTE:
        return QuotaExceeded(f"rate limit of {tier.requests_per_minute} requests per minute reached",
                             "rate_limit_exceeded", oldest_request + MINUTE - now, state)
    return QuotaExceeded(f"rate limit reached: {minute_used} of {tier.tokens_per_minute} tokens per minute in "
                         f"use, this request needs {tokens}", "rate_limit_exceeded", wait_s, state)


def quota_state(tier: Tier, minute_used: int, day_used: int, requests: int, newest_entry: float | None,
                oldest_request: float | None, now: float) -> QuotaState:
    """The x-ratelimit-* figures from a store's counters."""
    reset_tokens = (newest_entry + MINUTE - now) if minute_used and newest_entry is not None else 0.0
    reset_requests = (oldest_request + MINUTE - now) if requests and oldest_request is not None else 0.0
    remaining_tokens = min(tier.tokens_per_minute - minute_used, tier.tokens_per_day - day_used)
    return QuotaState(tier.requests_per_minute, tier.requests_per_minute - requests, reset_requests,
                      tier.tokens_per_minute, remaining_tokens, reset_tokens, day_used)


def _today(now: float) -> str:
    return datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%d")


def _seconds_to_midnight(now: float) -> float:
    t = datetime.fromtimestamp(now, timezone.utc)
    midnight = (t + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return (midnight - t).total_seconds()


def _locked(method):
    if inspect.iscoroutinefunction(method):
        # The memory store's async methods never suspend, so holding a thread lock across the await is safe.
        @functools.wraps(method)
        async def async_wrapper(self, *args, **kwargs):
            with self._lock:
                return await method(self, *args, **kwargs)
        return async_wrapper

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


class MemoryQuotaStore(QuotaStore):
    """Sliding one-minute windows and a UTC-day counter per user, in this process.
    Calls never await, so on one event loop each check-and-reserve is atomic; a lock keeps them
    atomic when a large request is checked in a worker thread (validation.off_loop)."""

    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self._users: dict[str, _UserCounters] = {}
        self._lock = threading.RLock()

    def _counters(self, user_id: str, now: float) -> _UserCounters:
        c = self._users.setdefault(user_id, _UserCounters())
        while c.minute and c.minute[0][0] <= now - MINUTE:
            entry = c.minute.popleft()
            entry[2] = False
            c.minute_tokens -= entry[1]
        while c.requests and c.requests[0] <= now - MINUTE:
            c.requests.popleft()
        today = _today(now)
        if c.day != today:
            c.day, c.day_tokens = today, 0
        return c

    @staticmethod
    def _minute_used(c: _UserCounters) -> int:
        return c.minute_tokens

    @staticmethod
    def _set_entry(c: _UserCounters, entry: list, tokens: int) -> None:
        """Change a reservation's tokens in the window; one that has left it changes nothing."""
        if entry[2]:
            c.minute_tokens += tokens - entry[1]
        entry[1] = tokens

    @staticmethod
    def _wait_for(c: _UserCounters, now: float, need: int, limit: int) -> float:
        """Seconds until the minute window has room for `need` more tokens."""
        used = c.minute_tokens
        for t, tokens, _ in c.minute:
            used -= tokens
            if used + need <= limit:
                return t + MINUTE - now
        return MINUTE

    def _check(self, c: _UserCounters, tier: Tier, tokens: int, now: float, new_request: bool,
               batch: bool = False) -> None:
        used = self._minute_used(c)
        kind = refusal_kind(tier, tokens, new_request, used, c.day_tokens, c.active, len(c.requests), batch)
        if kind is not None:
            wait = self._wait_for(c, now, tokens, tier.tokens_per_minute) if kind == TOKENS_PER_MINUTE else 0.0
            oldest = c.requests[0] if c.requests else now
            raise refusal(kind, tier, tokens, used, c.day_tokens, now, oldest, wait, self._state(c, tier, now))

    @_locked
    async def reserve(self, user_id: str, tier: Tier, tokens: int, batch: bool = False) -> Reservation:
        now = self.clock()
        c = self._counters(user_id, now)
        self._check(c, tier, tokens, now, new_request=True, batch=batch)
        if batch:
            c.day_tokens += tokens
            return Reservation(user_id, tokens, now, c.day, batch=True)
        entry = [now, tokens, True]
        c.minute.append(entry)
        c.minute_tokens += tokens
        c.requests.append(now)
        c.day_tokens += tokens
        c.active += 1
        return Reservation(user_id, tokens, now, c.day, _entry=entry)

    @_locked
    async def extend(self, reservation: Reservation, tier: Tier, tokens: int) -> None:
        extra = tokens - reservation.tokens
        if extra <= 0 or reservation.settled:
            return
        now = self.clock()
        c = self._counters(reservation.user_id, now)
        self._check(c, tier, extra, now, new_request=False, batch=reservation.batch)
        if reservation._entry:
            self._set_entry(c, reservation._entry, reservation._entry[1] + extra)
        c.day_tokens += extra
        reservation.tokens = tokens

    @_locked
    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        if reservation.settled:
            return
        reservation.settled = True
        now = self.clock()
        c = self._counters(reservation.user_id, now)
        delta = used_tokens - reservation.tokens
        if not reservation.batch:
            c.active = max(0, c.active - 1)
            self._set_entry(c, reservation._entry, used_tokens)
        if reservation.day == c.day:
            c.day_tokens = max(0, c.day_tokens + delta)

    def _state(self, c: _UserCounters, tier: Tier, now: float) -> QuotaState:
        return quota_state(tier, self._minute_used(c), c.day_tokens, len(c.requests),
                           c.minute[-1][0] if c.minute else None, c.requests[0] if c.requests else None, now)

    @_locked
    async def state(self, user_id: str, tier: Tier) -> QuotaState:
        now = self.clock()
        return self._state(self._counters(user_id, now), tier, now)

    @_locked
    def day_used(self, user_id: str) -> int:
        now = self.clock()
        return self._counters(user_id, now).day_tokens
