"""Token quotas in Redis, so every gateway counts against the same budgets.

Each call is one Lua script, and Redis runs a script alone: the check and the reservation cannot
interleave with another gateway's, so concurrent requests on any number of gateways are never
granted a token past the limit. Per user (keys share the user's hash tag, so a cluster keeps them
on one shard):

- `win`: the minute window, a sorted set of reservation ids scored by their time;
- `tok`: the tokens of each reservation still in the window or still running;
- `req`: request start times (requests per minute);
- `act`: running reservations, scored by when they stop counting (a gateway that died mid-answer
  does not hold a concurrency slot forever);
- `bat`: running batch reservations, scored the same way: they count against the day only, so they
  are in none of `win`, `req` and `act`;
- `day:<date>`: the tokens of one UTC day;
- `seeded:<date>`: when that day's count was started.

A day's count starts from what metering recorded for the user that day (`day_floor`), not from 0, so
a Redis that restarted without its data (or evicted the key) does not give every user a fresh daily
quota: whichever gateway finds the count missing (the day's first request, or the first after the loss,
on a gateway that had seen the count or not) reads metering's figure before it reserves. That costs one
database read per user and day across the fleet, and one more per user after a loss. A reservation made
before the count was started again and settled after it is added then (metering had not recorded it
yet); one the count already holds is adjusted as usual.

Time comes from the caller's clock (the gateways' clocks are assumed NTP-synced; tests inject one).
The refusals and the x-ratelimit-* figures are built by chatloom.app.traffic.quotas, exactly as in memory.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import redis.asyncio as redis
from redis.exceptions import RedisError

from chatloom.app.traffic.quotas import (QuotaState, QuotaStore, Reservation, TOKENS_PER_MINUTE, _today, quota_state,
                                 refusal)
from chatloom.app.traffic.tiers import Tier

# Drop what left the minute window (tokens stay while the reservation still runs), then read the figures.
_PRUNE_AND_READ = """
local win, tok, req, act, day, bat = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7]
local now = tonumber(ARGV[1])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', bat, '-inf', now)) do redis.call('HDEL', tok, id) end
redis.call('ZREMRANGEBYSCORE', bat, '-inf', now)
local old = redis.call('ZRANGEBYSCORE', win, '-inf', now - 60)
for _, id in ipairs(old) do
  if not redis.call('ZSCORE', act, id) then redis.call('HDEL', tok, id) end
end
redis.call('ZREMRANGEBYSCORE', win, '-inf', now - 60)
redis.call('ZREMRANGEBYSCORE', req, '-inf', now - 60)
redis.call('ZREMRANGEBYSCORE', act, '-inf', now)
local entries = redis.call('ZRANGE', win, 0, -1, 'WITHSCORES')
local used, times, amounts = 0, {}, {}
for i = 1, #entries, 2 do
  local n = tonumber(redis.call('HGET', tok, entries[i]) or '0')
  used = used + n
  times[#times + 1] = tonumber(entries[i + 1])
  amounts[#amounts + 1] = n
end
local day_used = tonumber(redis.call('GET', day) or '0')
local nreq = redis.call('ZCARD', req)
local active = redis.call('ZCARD', act)
local oldest = redis.call('ZRANGE', req, 0, 0, 'WITHSCORES')
local oldest_req = oldest[2] or ''
local newest = times[#times] or ''
"""

# Figures as strings: Redis would truncate Lua numbers to integers.
_FIGURES = "tostring(used), tostring(day_used), tostring(nreq), tostring(active), tostring(oldest_req), tostring(newest)"

_WAIT_FOR = """
local function wait_for(need, limit)
  local left = used
  for i = 1, #times do
    left = left - amounts[i]
    if left + need <= limit then return times[i] + 60 - now end
  end
  return 60
end
"""

_CHECK = """
local function check(tokens, new_request, batch)
  if tokens > tpm then return 1 end
  if day_used + tokens > tpd then return 2 end
  if batch then return 0 end
  if new_request and active >= max_conc then return 3 end
  if new_request and nreq >= rpm then return 4 end
  if used + tokens > tpm then return 5 end
  return 0
end
"""

# The day's count, when missing, starts from ARGV[9] (the metered figure); '' asks the caller for it.
_SEED_DAY = """
if redis.call('EXISTS', KEYS[5]) == 0 then
  if ARGV[9] == '' then return {'-1'} end
  redis.call('SET', KEYS[5], ARGV[9], 'EX', 2 * 86400)
  redis.call('SET', KEYS[6], ARGV[1], 'EX', 2 * 86400)
end
"""

RESERVE = _SEED_DAY + _PRUNE_AND_READ + _WAIT_FOR + """
local id, tokens = ARGV[2], tonumber(ARGV[3])
local tpm, tpd, rpm, max_conc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local hold_s, batch = tonumber(ARGV[8]), ARGV[10] == '1'
""" + _CHECK + """
local kind = check(tokens, true, batch)
if kind ~= 0 then
  local wait = 0
  if kind == 5 then wait = wait_for(tokens, tpm) end
  return {tostring(kind), tostring(wait), """ + _FIGURES + """}
end
if batch then
  redis.call('HSET', tok, id, tokens)
  redis.call('ZADD', bat, now + hold_s, id)
  redis.call('INCRBY', day, tokens)
  redis.call('EXPIRE', day, 2 * 86400)
  for _, k in ipairs({tok, bat}) do redis.call('EXPIRE', k, math.max(120, hold_s + 60)) end
  return {'0', '0', """ + _FIGURES + """}
end
redis.call('ZADD', win, now, id)
redis.call('HSET', tok, id, tokens)
redis.call('ZADD', req, now, id)
redis.call('ZADD', act, now + hold_s, id)
redis.call('INCRBY', day, tokens)
redis.call('EXPIRE', day, 2 * 86400)
for _, k in ipairs({win, tok, req, act}) do redis.call('EXPIRE', k, math.max(120, hold_s + 60)) end
return {'0', '0', """ + _FIGURES + """}
"""

EXTEND = _PRUNE_AND_READ + _WAIT_FOR + """
local id, extra = ARGV[2], tonumber(ARGV[3])
local tpm, tpd, rpm, max_conc = tonumber(ARGV[4]), tonumber(ARGV[5]), 0, 0
""" + _CHECK + """
local kind = check(extra, false, ARGV[6] == '1')
if kind ~= 0 then
  local wait = 0
  if kind == 5 then wait = wait_for(extra, tpm) end
  return {tostring(kind), tostring(wait), """ + _FIGURES + """}
end
if redis.call('HEXISTS', tok, id) == 1 then redis.call('HINCRBY', tok, id, extra) end
-- A missing day count is left for the next reservation to start from metering.
if redis.call('EXISTS', day) == 1 then redis.call('INCRBY', day, extra) end
return {'0', '0', """ + _FIGURES + """}
"""

# Settling happens once, whichever gateway does it: only the call that removes the running entry counts.
SETTLE = """
local tok, act, day, seeded, bat = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, used, reserved, created = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local running, batch = redis.call('ZREM', act, id), redis.call('ZREM', bat, id)
if running == 0 and batch == 0 then
  -- Unknown here: settled already, or made before the day's count was started again from metering.
  local since = tonumber(redis.call('GET', seeded) or 'nil')
  if since and created < since and redis.call('HEXISTS', tok, id) == 0 then
    redis.call('INCRBY', day, used)
    redis.call('HSET', tok, id, used)
    redis.call('EXPIRE', tok, 120)
  end
  return 0
end
local current = tonumber(redis.call('HGET', tok, id) or reserved)
if batch == 1 then
  redis.call('HDEL', tok, id)  -- in no minute window
elseif redis.call('HEXISTS', tok, id) == 1 then
  redis.call('HSET', tok, id, used)
end
local day_used = tonumber(redis.call('GET', day) or '0')
if redis.call('EXISTS', day) == 1 then
  redis.call('SET', day, math.max(0, day_used + used - current), 'KEEPTTL')
end
return 1
"""

STATE = _PRUNE_AND_READ + """
return {'0', '0', """ + _FIGURES + """}
"""


DayFloor = Callable[[str, str], Awaitable[int]]
log = logging.getLogger(__name__)
# How often a settle that met a Redis outage is tried again.
SETTLE_RETRY_S = 0.5


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


class RedisQuotaStore(QuotaStore):
    """The quota counters of a fleet of gateways, in one Redis."""

    def __init__(self, client: redis.Redis, prefix: str = "chatloom", clock=time.time,
                 hold_s: float = 3600.0, day_floor: DayFloor | None = None) -> None:
        self.client = client
        # (user id, UTC day) -> the tokens metering recorded; None: a missing day count starts at 0.
        self.day_floor = day_floor
        self.prefix = prefix
        self.clock = clock
        # A reservation nobody settles (its gateway died and no other took the job) stops holding a
        # concurrency slot after this long; its tokens stay counted, as they may have been used.
        self.hold_s = hold_s
        self._reserve = client.register_script(RESERVE)
        self._extend = client.register_script(EXTEND)
        self._settle = client.register_script(SETTLE)
        self._state = client.register_script(STATE)
        self._pending: set[asyncio.Task] = set()  # settles waiting for Redis (kept referenced while they run)

    def _keys(self, user_id: str, day: str) -> list[str]:
        base = f"{self.prefix}:quota:{{{user_id}}}"
        return [f"{base}:win", f"{base}:tok", f"{base}:req", f"{base}:act", f"{base}:day:{day}",
                f"{base}:seeded:{day}", f"{base}:bat"]

    @staticmethod
    def _figures(reply: list) -> tuple[int, float, int, int, int, int, float | None, float | None]:
        kind, wait, used, day_used, nreq, active, oldest, newest = (x.decode() if isinstance(x, bytes) else x
                                                                   for x in reply[:8])
        return (int(kind), float(wait), int(float(used)), int(float(day_used)), int(nreq), int(active),
                float(oldest) if oldest else None, float(newest) if newest else None)

    def _raise_if_refused(self, reply: list, tier: Tier, tokens: int, now: float) -> None:
        kind, wait, used, day_used, nreq, _active, oldest, newest = self._figures(reply)
        if kind:
            state = quota_state(tier, used, day_used, nreq, newest, oldest, now)
            raise refusal(kind, tier, tokens, used, day_used, now, oldest if oldest is not None else now,
                          wait if kind == TOKENS_PER_MINUTE else 0.0, state)

    async def reserve(self, user_id: str, tier: Tier, tokens: int, batch: bool = False) -> Reservation:
        now = self.clock()
        reservation = Reservation(user_id, tokens, now, _today(now), batch=batch)
        args = [repr(now), reservation.id, tokens, tier.tokens_per_minute, tier.tokens_per_day,
                tier.requests_per_minute, tier.max_concurrent, repr(self.hold_s)]
        keys = self._keys(user_id, reservation.day)
        # A missing count (the day's first request, or Redis lost it, whether this gateway had seen it or
        # not) starts from metering's figure: the script answers -1 and asks for it.
        flag = "1" if batch else "0"
        reply = await self._reserve(keys=keys, args=[*args, "" if self.day_floor else "0", flag])
        if _text(reply[0]) == "-1":
            floor = await self.day_floor(user_id, reservation.day)
            reply = await self._reserve(keys=keys, args=[*args, str(max(0, int(floor))), flag])
        self._raise_if_refused(reply, tier, tokens, now)
        return reservation

    async def extend(self, reservation: Reservation, tier: Tier, tokens: int) -> None:
        extra = tokens - reservation.tokens
        if extra <= 0 or reservation.settled:
            return
        now = self.clock()
        reply = await self._extend(keys=self._keys(reservation.user_id, reservation.day),
                                   args=[repr(now), reservation.id, extra, tier.tokens_per_minute,
                                         tier.tokens_per_day, "1" if reservation.batch else "0"])
        self._raise_if_refused(reply, tier, extra, now)
        reservation.tokens = tokens

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Counts `used_tokens` for the reservation instead of what it reserved. The answer is over
        whatever Redis says: when Redis is unreachable this returns at once and the settle is tried
        again in the background until Redis answers or the reservation's keys would have expired
        (until then the user's counts hold the whole reservation, so refusals come early, never late)."""
        if reservation.settled:
            return
        try:
            await self._settle_now(reservation, used_tokens)
        except RedisError as exc:
            log.warning("quota settle of %s waits for Redis (%s: %s)", reservation.id, type(exc).__name__, exc)
            task = asyncio.create_task(self._settle_later(reservation, used_tokens),
                                       name=f"quota-settle-{reservation.id}")
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _settle_now(self, reservation: Reservation, used_tokens: int) -> None:
        _win, tok, _req, act, day, seeded, bat = self._keys(reservation.user_id, reservation.day)
        await self._settle(keys=[tok, act, day, seeded, bat],
                           args=[reservation.id, used_tokens, reservation.tokens, repr(reservation.created)])
        reservation.settled = True

    async def _settle_later(self, reservation: Reservation, used_tokens: int) -> None:
        deadline = time.monotonic() + max(120.0, self.hold_s + 60.0)
        while time.monotonic() < deadline:
            await asyncio.sleep(SETTLE_RETRY_S)
            try:
                await self._settle_now(reservation, used_tokens)
            except RedisError:
                continue
            log.warning("quota settle of %s done once Redis was back", reservation.id)
            return
        log.warning("quota settle of %s given up: Redis did not come back", reservation.id)

    async def state(self, user_id: str, tier: Tier) -> QuotaState:
        now = self.clock()
        reply = await self._state(keys=self._keys(user_id, _today(now)), args=[repr(now)])
        _kind, _wait, used, day_used, nreq, _active, oldest, newest = self._figures(reply)
        return quota_state(tier, used, day_used, nreq, newest, oldest, now)
