"""A Redis that lost its data (restarted without persistence) must not hand every user a fresh daily
quota: the day's count starts again from what metering recorded, on every gateway (one that never saw
the count as well), and answers that were running across the loss are added when they settle."""
from __future__ import annotations

import uuid

import pytest

from chatloom.app.state.redis_connection import RedisHub
from chatloom.app.state.redis_quotas import RedisQuotaStore
from chatloom.app.traffic.quotas import QuotaExceeded
from chatloom.app.traffic.tiers import Tier

from backing_services import require_redis

TIER = Tier(name="t", tokens_per_minute=100_000, tokens_per_day=1000, requests_per_minute=10_000,
            max_concurrent=100, priority=0, reserved_share=0.0, max_tokens=500)


@pytest.fixture
async def redis_hub():
    hub = RedisHub(require_redis())
    yield hub
    await hub.close()


async def _forget_everything(hub: RedisHub, prefix: str) -> None:
    """What a restart without persistence does to this store's keys."""
    keys = [k async for k in hub.commands.scan_iter(f"{prefix}:*")]
    if keys:
        await hub.commands.delete(*keys)


async def test_the_day_count_starts_again_from_metering_after_a_loss(redis_hub):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    metered = {"u": 0}

    async def floor(user_id: str, day: str) -> int:
        return metered[user_id]

    store = RedisQuotaStore(redis_hub.commands, prefix, day_floor=floor)
    r = await store.reserve("u", TIER, 900)
    await store.settle(r, 900)
    metered["u"] = 900  # what the answer's metering wrote
    running = await store.reserve("u", TIER, 50)  # in flight when Redis loses its data
    await _forget_everything(redis_hub, prefix)
    with pytest.raises(QuotaExceeded) as refused:
        await store.reserve("u", TIER, 200)  # 900 metered + 200 > 1000
    assert refused.value.code == "insufficient_quota"
    await store.settle(running, 40)  # the answer in flight ends: its 40 tokens count too
    ok = await store.reserve("u", TIER, 60)  # 900 + 40 + 60 = 1000
    await store.settle(ok, 60)
    with pytest.raises(QuotaExceeded):
        await store.reserve("u", TIER, 1)


async def test_without_metering_a_missing_day_count_starts_at_zero(redis_hub):
    store = RedisQuotaStore(redis_hub.commands, f"t{uuid.uuid4().hex[:8]}")
    r = await store.reserve("u", TIER, 1000)
    await store.settle(r, 1000)
    with pytest.raises(QuotaExceeded):
        await store.reserve("u", TIER, 1)


async def test_a_gateway_refuses_past_the_daily_quota_after_redis_lost_it(tmp_path, db_url, redis_hub):
    import httpx

    from chatloom.app.main import create_app

    from app_testing import make_settings, signup
    from traffic_testing import ScriptedBackend, write_tiers

    prefix = f"t{uuid.uuid4().hex[:8]}"
    tiers = write_tiers(tmp_path, free={"tokens_per_day": 60, "tokens_per_minute": 100_000,
                                        "max_concurrent": 100, "requests_per_minute": 10_000})
    settings = make_settings(tmp_path, server={"db_url": db_url}, traffic={"tiers_file": tiers},
                             moderation={"mode": "off"}, shared_state={"redis_url": require_redis(), "prefix": prefix})
    app = create_app(settings, ScriptedBackend(["a", " b", " c", " d", " e"]))
    body = {"model": "scripted", "max_tokens": 5, "messages": [{"role": "user", "content": "hi there"}]}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        alice = await signup(client, "alice")
        statuses = [(await client.post("/v1/chat/completions", headers=alice, json=body)).status_code
                    for _ in range(8)]
        assert statuses[:6] == [200] * 6 and statuses[6:] == [429, 429]  # 6 x 10 tokens of 60 a day
        await _forget_everything(redis_hub, prefix)
        r = await client.post("/v1/chat/completions", headers=alice, json=body)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "insufficient_quota"


async def _one_grant_metered(redis_hub, tokens: int):
    """A fresh prefix, a gateway's store that granted user u `tokens` today, and the metering floor that
    recorded them: (prefix, that store, the floor function)."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    metered = {"u": 0}

    async def floor(user_id: str, day: str) -> int:
        return metered[user_id]

    first = RedisQuotaStore(redis_hub.commands, prefix, day_floor=floor)
    await first.settle(await first.reserve("u", TIER, tokens), tokens)
    metered["u"] = tokens
    return prefix, first, floor


async def test_a_count_seen_only_by_refusals_is_started_from_metering_too(redis_hub):
    """A user over quota gets only refusals from a gateway (started after the user's last grant): the
    count it refused against is one it has seen, and losing it must not reopen the quota."""
    prefix, first, floor = await _one_grant_metered(redis_hub, 1000)
    later = RedisQuotaStore(redis_hub.commands, prefix, day_floor=floor)  # a gateway restarted since
    with pytest.raises(QuotaExceeded):
        await later.reserve("u", TIER, 10)
    await _forget_everything(redis_hub, prefix)
    with pytest.raises(QuotaExceeded):
        await later.reserve("u", TIER, 10)


async def test_a_gateway_that_never_saw_the_count_starts_it_from_metering(redis_hub):
    """The count is lost before a gateway started after the user's last grant reserves for them: it has
    never seen the count, and must still start it from metering. Before, it started it from 0."""
    prefix, first, floor = await _one_grant_metered(redis_hub, 950)
    await _forget_everything(redis_hub, prefix)
    fresh = RedisQuotaStore(redis_hub.commands, prefix, day_floor=floor)  # started after the loss
    with pytest.raises(QuotaExceeded) as refused:
        await fresh.reserve("u", TIER, 100)  # 950 metered + 100 > 1000
    assert refused.value.code == "insufficient_quota"
    ok = await fresh.reserve("u", TIER, 50)  # 950 + 50 = 1000: the rest of the day is still there
    await fresh.settle(ok, 50)
    with pytest.raises(QuotaExceeded):
        await first.reserve("u", TIER, 1)  # and every gateway counts on from the same figure


async def test_two_gateways_after_a_loss_both_refuse_past_the_quota(tmp_path, db_url, redis_hub):
    """Through the whole app: a user spends the day's quota on gateway 1, Redis loses its data, and the
    user's first request ever on gateway 2 is refused (its count starts from the metered usage)."""
    from contextlib import AsyncExitStack

    from app_testing import signup
    from test_shared_state import gateways
    from traffic_testing import ScriptedBackend, write_tiers

    tiers = write_tiers(tmp_path, free={"tokens_per_day": 60, "tokens_per_minute": 100_000,
                                        "max_concurrent": 100, "requests_per_minute": 10_000})
    body = {"model": "scripted", "max_tokens": 5, "messages": [{"role": "user", "content": "hi there"}]}
    async with AsyncExitStack() as stack:
        g1, g2 = await gateways(stack, tmp_path, db_url, require_redis(), ScriptedBackend(["a", " b", " c", " d", " e"]),
                                traffic={"tiers_file": tiers}, moderation={"mode": "off"})
        alice = await signup(g1, "alice")
        statuses = [(await g1.post("/v1/chat/completions", headers=alice, json=body)).status_code for _ in range(7)]
        assert statuses == [200] * 6 + [429]  # 6 x 10 tokens of 60 a day
        prefix = g1._transport.app.state.ctx.settings.shared_state.prefix
        await _forget_everything(redis_hub, prefix)
        r = await g2.post("/v1/chat/completions", headers=alice, json=body)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "insufficient_quota"
