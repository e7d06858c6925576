"""The caller cache: an authenticated caller is not looked up again for auth_cache_s seconds (issue 12:
a burst must not queue behind the database before it can be refused), and changes made through this
gateway (a tier, a revoked key) apply at once."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import httpx
from sqlalchemy import event

from chatloom.app.core.caller_cache import CallerCache
from chatloom.app.main import create_app
from chatloom.store import User

from app_testing import make_settings, signup
from traffic_testing import ScriptedBackend


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _user(uid: str = "usr_1", tier: str = "free") -> User:
    return User(id=uid, username="alice", password_hash="secret", is_admin=False, tier=tier)


def test_entries_expire_after_ttl_and_hold_no_password():
    clock = Clock()
    cache = CallerCache(5.0, clock)
    cache.put("usr:usr_1", _user())
    cached = cache.get("usr:usr_1")
    assert cached is not None and cached.tier == "free" and cached.password_hash is None
    clock.now += 4.9
    assert cache.get("usr:usr_1") is not None
    clock.now += 0.2
    assert cache.get("usr:usr_1") is None


def test_forget_user_drops_all_of_its_credentials_and_ttl_zero_caches_nothing():
    cache = CallerCache(5.0)
    cache.put("usr:usr_1", _user())
    cache.put("key:abc", _user())
    cache.put("usr:usr_2", _user("usr_2"))
    cache.forget_user("usr_1")
    assert cache.get("usr:usr_1") is None and cache.get("key:abc") is None and cache.get("usr:usr_2") is not None
    off = CallerCache(0.0)
    off.put("usr:usr_1", _user())
    assert off.get("usr:usr_1") is None


@asynccontextmanager
async def _app(tmp_path, **settings):
    app = create_app(make_settings(tmp_path, **settings), ScriptedBackend())
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            yield app, client


def _count_queries(app) -> list[str]:
    statements: list[str] = []
    event.listen(app.state.ctx.db.engine.sync_engine, "before_cursor_execute",
                 lambda conn, cursor, statement, *rest: statements.append(statement))
    return statements


async def test_repeated_requests_are_authenticated_without_the_database(tmp_path):
    async with _app(tmp_path) as (app, c):
        alice = await signup(c, "alice")
        statements = _count_queries(app)
        for _ in range(5):
            assert (await c.get("/auth/me", headers=alice)).status_code == 200
        assert len([s for s in statements if "FROM users" in s]) == 1, statements
        # A forged token is still refused: the token is verified on every request.
        forged = {"Authorization": alice["Authorization"][:-2] + "xx"}
        assert (await c.get("/auth/me", headers=forged)).status_code == 401


async def test_api_keys_are_cached_and_a_revoked_key_stops_at_once(tmp_path):
    async with _app(tmp_path) as (app, c):
        alice = await signup(c, "alice")
        created = (await c.post("/auth/api-keys", headers=alice, json={"name": "sdk"})).json()
        key = {"Authorization": f"Bearer {created['key']}"}
        statements = _count_queries(app)
        for _ in range(3):
            assert (await c.get("/v1/models", headers=key)).status_code == 200
        assert len([s for s in statements if "FROM api_keys" in s]) == 1, statements
        assert (await c.delete(f"/auth/api-keys/{created['id']}", headers=alice)).status_code == 204
        assert (await c.get("/v1/models", headers=key)).status_code == 401


async def test_a_tier_set_by_an_admin_applies_from_the_next_request(tmp_path):
    async with _app(tmp_path) as (app, c):
        root = await signup(c, "root")
        bob = await signup(c, "bob")
        assert (await c.get("/auth/me", headers=bob)).json()["tier"] == "free"  # now cached
        assert (await c.put("/admin/users/bob/tier", json={"tier": "pro"}, headers=root)).status_code == 200
        assert (await c.get("/auth/me", headers=bob)).json()["tier"] == "pro"


async def test_without_the_cache_every_request_looks_the_caller_up(tmp_path):
    async with _app(tmp_path, accounts={"auth_cache_s": 0}) as (app, c):
        alice = await signup(c, "alice")
        statements = _count_queries(app)
        for _ in range(3):
            assert (await c.get("/auth/me", headers=alice)).status_code == 200
        assert len([s for s in statements if "FROM users" in s]) == 3, statements


async def test_a_caller_who_keeps_coming_back_is_still_looked_up_again_after_the_ttl(tmp_path):
    # A hit must not extend the entry: a tier changed on another gateway is seen within auth_cache_s.
    async with _app(tmp_path) as (app, c):
        alice = await signup(c, "alice")
        clock = Clock()
        app.state.ctx.callers.clock = clock
        statements = _count_queries(app)
        for _ in range(4):
            assert (await c.get("/auth/me", headers=alice)).status_code == 200
            clock.now += 2.0  # every 2 s, with a 5 s time to live
        assert len([s for s in statements if "FROM users" in s]) == 2, statements


async def test_a_burst_with_one_api_key_looks_it_up_once(tmp_path):
    async with _app(tmp_path) as (app, c):
        alice = await signup(c, "alice")
        created = (await c.post("/auth/api-keys", headers=alice, json={"name": "sdk"})).json()
        key = {"Authorization": f"Bearer {created['key']}"}
        statements = _count_queries(app)
        answers = await asyncio.gather(*(c.get("/v1/models", headers=key) for _ in range(20)))
        assert [a.status_code for a in answers] == [200] * 20
        assert len([s for s in statements if "FROM api_keys" in s]) == 1, statements
        # A wrong key in a burst: every request is refused, with one lookup.
        wrong = {"Authorization": "Bearer " + created["key"][:-3] + "zzz"}
        statements.clear()
        answers = await asyncio.gather(*(c.get("/v1/models", headers=wrong) for _ in range(5)))
        assert [a.status_code for a in answers] == [401] * 5
        assert len([s for s in statements if "FROM api_keys" in s]) == 1, statements


async def test_a_cancelled_lookup_lets_the_waiting_request_look_up_itself():
    cache = CallerCache(5.0)
    started, release = asyncio.Event(), asyncio.Event()

    async def slow() -> User:
        started.set()
        await release.wait()
        return _user()

    async def fast() -> User:
        return _user("usr_2")

    leader = asyncio.create_task(cache.load_once("key:k", slow))
    await started.wait()
    waiter = asyncio.create_task(cache.load_once("key:k", fast))
    await asyncio.sleep(0)
    leader.cancel()
    assert (await waiter).id == "usr_2"
