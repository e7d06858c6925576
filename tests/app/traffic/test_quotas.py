"""Token quotas: reservations at admission, settled at the end; 429 with Retry-After and x-ratelimit-*."""
from __future__ import annotations

import asyncio
import random
import time
import uuid

import httpx
import pytest

from chatloom.app.state.redis_connection import RedisHub
from chatloom.app.state.redis_quotas import RedisQuotaStore
from chatloom.app.main import create_app
from chatloom.app.traffic.quotas import MemoryQuotaStore, QuotaExceeded, Reservation, duration
from chatloom.app.traffic.tiers import Tier

from app_testing import make_settings, new_conversation, parse_sse, signup
from traffic_testing import ScriptedBackend, write_tiers
from backing_services import require_redis


def small_tier(**changes) -> Tier:
    fields = dict(name="t", tokens_per_minute=300, tokens_per_day=10_000, requests_per_minute=10_000,
                  max_concurrent=1000, priority=0, reserved_share=0.0, max_tokens=100)
    fields.update(changes)
    return Tier(**fields)


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["memory", "redis"])
async def make_store(request):
    """A quota store factory over a clock: in this process, or in Redis (skipped without a server)."""
    if request.param == "memory":
        yield lambda clock=time.time: MemoryQuotaStore(clock)
        return
    hub = RedisHub(require_redis())
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    yield lambda clock=time.time: RedisQuotaStore(hub.commands, prefix, clock)
    await hub.close()


async def test_fifty_concurrent_reservations_never_exceed_the_limit(make_store):
    store = make_store()
    tier = small_tier(tokens_per_minute=1000)
    granted = []

    async def one(i: int) -> None:
        await asyncio.sleep(0)
        try:
            r = await store.reserve("u", tier, 70)
        except QuotaExceeded:
            return
        granted.append(r)
        await asyncio.sleep(0.01)
        await store.settle(r, 70)

    await asyncio.gather(*(one(i) for i in range(50)))
    assert len(granted) == 1000 // 70 and sum(r.tokens for r in granted) <= 1000


async def test_settling_gives_back_unused_tokens_and_retry_after_counts_down(make_store):
    clock = Clock()
    store = make_store(clock)
    tier = small_tier(tokens_per_minute=100)
    r = await store.reserve("u", tier, 90)  # 10 prompt + 80 max_tokens
    await store.settle(r, 30)  # the answer was short
    await store.settle(r, 30)  # settling twice changes nothing
    assert (await store.state("u", tier)).remaining_tokens == 70
    clock.t += 20
    await store.reserve("u", tier, 60)
    try:
        await store.reserve("u", tier, 40)
        raise AssertionError("over the limit")
    except QuotaExceeded as exc:
        # Enough frees up when the first request (30 tokens, 20 s ago) leaves the window: 40 s.
        assert exc.code == "rate_limit_exceeded" and round(exc.retry_after) == 40
        assert exc.state.remaining_tokens == 10 and exc.state.limit_tokens == 100
    clock.t += 41
    await store.reserve("u", tier, 40)


async def test_extending_counts_the_extra_tokens(make_store):
    store = make_store(Clock())
    tier = small_tier(tokens_per_minute=100)
    r = await store.reserve("u", tier, 50)
    await store.extend(r, tier, 80)  # the exact prompt was larger than estimated
    assert r.tokens == 80 and (await store.state("u", tier)).remaining_tokens == 20
    try:
        await store.extend(r, tier, 130)
        raise AssertionError("extended past the limit")
    except QuotaExceeded as exc:
        assert "80 of 100" in str(exc)
    await store.settle(r, 80)
    assert (await store.state("u", tier)).remaining_tokens == 20


async def test_the_minute_window_counts_what_its_reservations_hold_now(make_store):
    """Reservations made, grown and settled while the clock runs past the one-minute window, some settled
    after they left it: the window always holds the sum over the reservations made in the last minute."""
    rng = random.Random(7)
    clock = Clock()
    store = make_store(clock)
    tier = small_tier(tokens_per_minute=10**9, tokens_per_day=10**12)
    made: list[tuple[float, Reservation]] = []  # every reservation, settled or not, with its time
    running: list[Reservation] = []
    for _ in range(300):
        clock.t += rng.uniform(0, 1.5)
        roll = rng.random()
        if roll < 0.5 or not running:
            r = await store.reserve("u", tier, rng.randint(1, 500))
            made.append((clock.t, r))
            running.append(r)
        elif roll < 0.65:
            r = rng.choice(running)
            await store.extend(r, tier, r.tokens + rng.randint(0, 300))
        else:
            r = running.pop(rng.randrange(len(running)))
            used = rng.randint(0, r.tokens)
            await store.settle(r, used)
            r.tokens = used  # what it counts from now on
        expected = sum(r.tokens for t, r in made if t > clock.t - 60)
        assert tier.tokens_per_minute - (await store.state("u", tier)).remaining_tokens == expected


async def test_daily_limit_is_insufficient_quota_until_midnight(make_store):
    store = make_store(Clock(86400 * 20000 + 3600 * 23))  # 23:00 UTC
    tier = small_tier(tokens_per_day=100)
    await store.settle(await store.reserve("u", tier, 90), 90)
    try:
        await store.reserve("u", tier, 20)
        raise AssertionError("over the daily limit")
    except QuotaExceeded as exc:
        assert exc.code == "insufficient_quota" and round(exc.retry_after) == 3600


async def test_concurrency_limit_and_durations(make_store):
    store = make_store()
    tier = small_tier(max_concurrent=2)
    a, _ = await store.reserve("u", tier, 1), await store.reserve("u", tier, 1)
    try:
        await store.reserve("u", tier, 1)
        raise AssertionError("three at once")
    except QuotaExceeded as exc:
        assert "at most 2" in str(exc)
    await store.settle(a, 1)
    await store.reserve("u", tier, 1)
    assert duration(0.2) == "1s" and duration(360) == "6m0s" and duration(3723) == "1h2m3s"


async def test_requests_per_minute(make_store):
    clock = Clock()
    store = make_store(clock)
    tier = small_tier(requests_per_minute=3)
    for _ in range(3):
        await store.settle(await store.reserve("u", tier, 1), 1)
        clock.t += 10
    try:
        await store.reserve("u", tier, 1)
        raise AssertionError("a fourth request in a minute")
    except QuotaExceeded as exc:
        assert "3 requests per minute" in str(exc) and round(exc.retry_after) == 30
    await store.reserve("other-user", tier, 1)  # users do not share counters


async def test_batch_reservations_count_against_the_day_only(make_store):
    """A running batch takes none of the user's requests, tokens per minute or concurrent generations:
    their chat goes on beside it. Its tokens count against the day's quota, and settle like any other."""
    clock = Clock()
    store = make_store(clock)
    tier = small_tier(tokens_per_minute=100, tokens_per_day=1000, requests_per_minute=2, max_concurrent=1)
    running = [await store.reserve("u", tier, 90, batch=True) for _ in range(5)]  # more than any minute allows
    assert all(r.batch for r in running)
    state = await store.state("u", tier)
    assert state.remaining_requests == 2 and state.remaining_tokens == 100
    chat = await store.reserve("u", tier, 90)  # the user's own chat is not refused
    await store.extend(running[0], tier, 95)  # a batch prompt found larger: the day's count only
    await store.settle(chat, 40)
    for r in running:
        await store.settle(r, 10)
    await store.settle(running[0], 10)  # settling twice changes nothing
    clock.t += 61
    # The day holds the chat's 40 and the batch's 5 x 10 (90): 9 more of 100 in one minute, then 10 more.
    for _ in range(9):
        await store.settle(await store.reserve("u", tier, 100, batch=True), 100)
    with pytest.raises(QuotaExceeded) as refused:
        await store.reserve("u", tier, 20, batch=True)
    assert refused.value.code == "insufficient_quota" and "990 of 1000" in str(refused.value)
    await store.reserve("u", tier, 10, batch=True)
    with pytest.raises(QuotaExceeded) as too_big:  # larger than a minute's tokens: as for any request
        await store.reserve("other", tier, 101, batch=True)
    assert too_big.value.code == "rate_limit_exceeded"


def app_with(tmp_path, backend, **settings):
    return create_app(make_settings(tmp_path, **settings), backend)


async def test_fifty_concurrent_api_requests_never_get_more_than_the_limit(tmp_path):
    # Each request: prompt 2 words + 3 = 5 tokens, max_tokens 5: reserves 10. The limit is 95 a minute.
    tiers = write_tiers(tmp_path, free={"tokens_per_minute": 95, "max_concurrent": 100,
                                        "requests_per_minute": 1000})
    backend = ScriptedBackend(["a", " b", " c", " d", " e"], delay_s=0.01)
    app = app_with(tmp_path, backend, traffic={"tiers_file": tiers}, moderation={"mode": "off"})
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            await signup(c, "root")
            user = await signup(c, "alice")
            body = {"model": "scripted", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5}
            results = await asyncio.gather(*(c.post("/v1/chat/completions", json=body, headers=user)
                                             for _ in range(50)))
    ok = [r for r in results if r.status_code == 200]
    limited = [r for r in results if r.status_code == 429]
    assert len(ok) + len(limited) == 50
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    assert len(ok) == 9 and used <= 95, (len(ok), used)
    assert len(backend.requests) == len(ok)  # refused requests cost no model work
    for r in limited:
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-limit-tokens"] == "95"


async def test_429_carries_retry_after_and_ratelimit_headers(tmp_path):
    tiers = write_tiers(tmp_path, free={"tokens_per_minute": 60, "tokens_per_day": 1000})
    backend = ScriptedBackend(["ok"])
    app = app_with(tmp_path, backend, traffic={"tiers_file": tiers}, sampling={"max_tokens": 40})
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            alice = await signup(c, "alice")
            # Every response to a signed-in caller carries the headers, not only generations.
            r = await c.get("/conversations", headers=alice)
            for kind in ("requests", "tokens"):
                for what in ("limit", "remaining", "reset"):
                    assert f"x-ratelimit-{what}-{kind}" in r.headers
            assert r.headers["x-ratelimit-limit-tokens"] == "60"
            assert r.headers["x-ratelimit-remaining-tokens"] == "60"
            cid = await new_conversation(c, alice)
            r = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hello"})
            assert r.status_code == 200 and parse_sse(r.text)[-1].data["done"]
            used = int(r.headers["x-ratelimit-limit-tokens"]) - int(r.headers["x-ratelimit-remaining-tokens"])
            assert used > 40  # reserved: prompt + max_tokens
            r = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "again"})
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
            assert 1 <= int(r.headers["retry-after"]) <= 60
            assert r.headers["x-ratelimit-limit-tokens"] == "60"
            assert int(r.headers["x-ratelimit-remaining-tokens"]) < 60
            assert r.headers["x-ratelimit-reset-tokens"].endswith("s")
            # The refused message was not saved.
            conv = (await c.get(f"/conversations/{cid}", headers=alice)).json()
            assert len(conv["messages"]) == 2


async def test_daily_quota_gives_insufficient_quota(tmp_path):
    tiers = write_tiers(tmp_path, free={"tokens_per_minute": 10_000, "tokens_per_day": 18})
    app = app_with(tmp_path, ScriptedBackend(["ok"]), traffic={"tiers_file": tiers})
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            alice = await signup(c, "alice")
            body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
            assert (await c.post("/v1/chat/completions", json=body, headers=alice)).status_code == 200
            r = await c.post("/v1/chat/completions", json=body, headers=alice)
            assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
            assert int(r.headers["retry-after"]) > 0


async def test_tier_caps_max_tokens_and_models(tmp_path):
    tiers = write_tiers(tmp_path, free={"max_tokens": 2, "models": ["scripted"]},
                        plus={"models": ["other"]})
    backend = ScriptedBackend(["a", " b", " c", " d"])
    app = app_with(tmp_path, backend, traffic={"tiers_file": tiers})
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            root = await signup(c, "root")
            bob = await signup(c, "bob")
            body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
            r = await c.post("/v1/chat/completions", json=body, headers=bob)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            assert backend.requests[-1].max_tokens == 2
            r = await c.put("/admin/users/bob/tier", json={"tier": "plus"}, headers=root)
            assert r.status_code == 200 and r.json() == {"username": "bob", "tier": "plus"}
            r = await c.post("/v1/chat/completions", json=body, headers=bob)
            assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
            # Bad admin input is a 4xx, never a 500.
            assert (await c.put("/admin/users/bob/tier", json={"tier": "gold"}, headers=root)).status_code == 400
            assert (await c.put("/admin/users/nobody/tier", json={"tier": "pro"}, headers=root)).status_code == 404
            assert (await c.put("/admin/users/bob/tier", json={"tier": 3}, headers=root)).status_code == 422
            assert (await c.put("/admin/users/root/tier", json={"tier": "pro"}, headers=bob)).status_code == 403


@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
async def test_cached_prompt_tokens_cost_the_quota_at_the_discount(tmp_path, discount):
    tiers = write_tiers(tmp_path, free={"tokens_per_minute": 1000, "tokens_per_day": 100000})
    backend = ScriptedBackend(["a", " b", " c"], cached=8)
    app = app_with(tmp_path, backend, traffic={"tiers_file": tiers, "cached_input_discount": discount},
                   moderation={"mode": "off"})
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            alice = await signup(c, "alice")
            body = {"model": "scripted", "max_tokens": 3,
                    "messages": [{"role": "user", "content": "one two three four five six seven eight nine ten"}]}
            r = await c.post("/v1/chat/completions", json=body, headers=alice)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 8
            r = await c.get("/conversations", headers=alice)
            charged = 1000 - int(r.headers["x-ratelimit-remaining-tokens"])
            assert charged == usage["total_tokens"] - int(8 * discount)
            # Metering keeps the cached tokens apart, at full count (metered as the run closes).
            for _ in range(500):
                totals = (await c.get("/usage", headers=alice)).json()["totals"]
                if totals["requests"]:
                    break
                await asyncio.sleep(0.01)
            assert totals["cached_tokens"] == 8 and totals["total_tokens"] == usage["total_tokens"]
