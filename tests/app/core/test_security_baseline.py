"""The security baseline: brute-force limits on sign-in and sign-up, scoped and expiring API keys, signing
out everywhere, the audit log, security headers and CORS (docs/security.md lists each with its test)."""
from __future__ import annotations

import uuid
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import update

from chatloom.app.core.auth import Passwords
from chatloom.app.main import create_app
from chatloom.settings import Settings
from chatloom.store import ApiKey
from chatloom.store.models import utcnow

from app_testing import app_client, make_settings, signup
from backing_services import require_redis

MESSAGES = [{"role": "user", "content": "hi"}]


def _settings(tmp_path, db_url="sqlite", **accounts) -> Settings:
    server = {} if db_url == "sqlite" else {"db_url": db_url}
    return make_settings(tmp_path, server=server, accounts=accounts)


async def _login(client, username, password):
    return await client.post("/auth/login", json={"username": username, "password": password})


async def test_failed_sign_ins_lock_the_username_then_say_when_to_retry(tmp_path, tiny_backend):
    settings = _settings(tmp_path, login_failures_per_account=3, login_failures_per_address=100)
    async with app_client(settings, tiny_backend) as (client, _app, _alice):
        await signup(client, "bob")
        for _ in range(3):
            assert (await _login(client, "bob", "wrong password")).status_code == 401
        r = await _login(client, "bob", "correct horse")  # the right password too, once locked
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_attempts"
        assert 1 <= int(r.headers["retry-after"]) <= 900
        assert (await _login(client, "alice", "correct horse")).status_code == 200  # another name is free


async def test_one_address_guessing_many_names_is_limited(tmp_path, tiny_backend):
    settings = _settings(tmp_path, login_failures_per_account=100, login_failures_per_address=4)
    async with app_client(settings, tiny_backend) as (client, _app, _alice):
        for i in range(4):
            assert (await _login(client, f"user{i}", "guess")).status_code == 401
        r = await _login(client, "alice", "correct horse")
        assert r.status_code == 429 and "retry-after" in r.headers


async def test_a_successful_sign_in_clears_the_usernames_count(tmp_path, tiny_backend):
    settings = _settings(tmp_path, login_failures_per_account=3, login_failures_per_address=100)
    async with app_client(settings, tiny_backend) as (client, _app, _alice):
        for _ in range(2):
            await _login(client, "alice", "wrong")
        assert (await _login(client, "alice", "correct horse")).status_code == 200
        for _ in range(2):
            await _login(client, "alice", "wrong")
        assert (await _login(client, "alice", "correct horse")).status_code == 200


async def test_sign_ups_from_one_address_are_limited(tmp_path, tiny_backend):
    settings = _settings(tmp_path, signups_per_address=3)
    async with app_client(settings, tiny_backend) as (client, _app, _alice):  # alice is the first
        await signup(client, "bob")
        r = await client.post("/auth/signup", json={"username": "bob", "password": "correct horse"})
        assert r.status_code == 409  # a refused attempt counts too
        r = await client.post("/auth/signup", json={"username": "carol", "password": "correct horse"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_attempts"


async def test_the_limits_hold_across_gateways_sharing_redis(tmp_path, tiny_backend):
    shared = {"redis_url": require_redis(), "prefix": f"t{uuid.uuid4().hex[:8]}"}
    one = make_settings(tmp_path / "a", accounts={"login_failures_per_account": 2}, shared_state=shared,
                        server={"db_url": f"sqlite+aiosqlite:///{tmp_path}/shared.db"})
    two = make_settings(tmp_path / "b", accounts={"login_failures_per_account": 2}, shared_state=shared,
                        server={"db_url": f"sqlite+aiosqlite:///{tmp_path}/shared.db"})
    second_app = create_app(two, tiny_backend)
    async with app_client(one, tiny_backend) as (first, _a, _alice), second_app.router.lifespan_context(second_app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=second_app), base_url="http://test") as second:
        assert (await _login(first, "alice", "wrong")).status_code == 401
        assert (await _login(second, "alice", "wrong")).status_code == 401
        assert (await _login(first, "alice", "correct horse")).status_code == 429


async def test_an_unknown_username_costs_a_password_check_too(monkeypatch):
    passwords = Passwords(time_cost=1, memory_kib=1024)
    checked: list[str] = []
    real = passwords._hasher

    class Counting:
        def verify(self, password_hash: str, password: str) -> bool:
            checked.append(password_hash)
            return real.verify(password_hash, password)

        def hash(self, password: str) -> str:
            return real.hash(password)

    monkeypatch.setattr(passwords, "_hasher", Counting())
    assert await passwords.verify(None, "anything") is False
    assert len(checked) == 1 and checked[0].startswith("$argon2")


async def test_api_key_scopes(tmp_path, tiny_backend):
    async with app_client(_settings(tmp_path), tiny_backend) as (client, _app, alice):
        bob = await signup(client, "bob")

        async def key(headers, **body):
            r = await client.post("/auth/api-keys", headers=headers, json=body)
            return r, {"Authorization": f"Bearer {r.json().get('key')}"}

        r, read_only = await key(bob, scopes=["read"])
        assert r.status_code == 201 and r.json()["scopes"] == ["read"]
        assert (await client.get("/conversations", headers=read_only)).status_code == 200
        r = await client.post("/v1/chat/completions", headers=read_only,
                              json={"model": "tiny-random", "messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
        assert "'chat'" in r.json()["error"]["message"]

        _, default = await key(bob)  # read and chat
        assert (await client.post("/conversations", headers=default)).status_code == 201
        # A key never makes a key with more rights than its own.
        r, _ = await key(read_only, scopes=["read", "chat"])
        assert r.status_code == 403
        # Only an admin account's key may hold admin, and only such a key reaches /admin.
        r, _ = await key(bob, scopes=["admin"])
        assert r.status_code == 403
        r, admin_key = await key(alice, scopes=["admin"])
        assert r.status_code == 201
        assert (await client.get("/admin/stats", headers=admin_key)).status_code == 200
        _, alice_chat = await key(alice)
        r = await client.get("/admin/stats", headers=alice_chat)
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
        assert (await client.get("/conversations", headers=admin_key)).status_code == 403


async def test_api_keys_expire(tmp_path, tiny_backend, db_url):
    async with app_client(_settings(tmp_path, db_url, api_key_max_days=30), tiny_backend) as (client, app, alice):
        r = await client.post("/auth/api-keys", headers=alice, json={"expires_in_days": 31})
        assert r.status_code == 400 and r.json()["error"]["param"] == "expires_in_days"
        r = await client.post("/auth/api-keys", headers=alice, json={})  # capped: 30 days
        assert r.status_code == 201 and r.json()["expires_at"] is not None
        key_id, key = r.json()["id"], {"Authorization": f"Bearer {r.json()['key']}"}
        assert (await client.get("/auth/me", headers=key)).status_code == 200
        async with app.state.ctx.db.session() as session:
            await session.execute(update(ApiKey).where(ApiKey.id == key_id)
                                  .values(expires_at=utcnow() - timedelta(seconds=1)))
            await session.commit()
        app.state.ctx.callers.forget_user((await client.get("/auth/me", headers=alice)).json()["id"])
        r = await client.get("/auth/me", headers=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_expired"


async def test_revoke_all_signs_the_account_out_everywhere(tmp_path, tiny_backend, db_url):
    async with app_client(_settings(tmp_path, db_url), tiny_backend) as (client, _app, alice):
        key = {"Authorization": f"Bearer {(await client.post('/auth/api-keys', headers=alice)).json()['key']}"}
        other_session = {"Authorization": f"Bearer {(await _login(client, 'alice', 'correct horse')).json()['token']}"}
        assert (await client.post("/auth/revoke-all", headers=alice)).status_code == 204
        for headers in (alice, key, other_session):
            r = await client.get("/auth/me", headers=headers)
            assert r.status_code == 401, headers
        fresh = {"Authorization": f"Bearer {(await _login(client, 'alice', 'correct horse')).json()['token']}"}
        assert (await client.get("/auth/me", headers=fresh)).status_code == 200


async def test_the_audit_log_records_security_events_and_admin_actions(tmp_path, tiny_backend, db_url):
    async with app_client(_settings(tmp_path, db_url), tiny_backend) as (client, _app, alice):
        bob = await signup(client, "bob")
        await _login(client, "bob", "wrong password")
        await _login(client, "bob", "correct horse")
        created = (await client.post("/auth/api-keys", headers=bob, json={"name": "ci"})).json()
        await client.delete(f"/auth/api-keys/{created['id']}", headers=bob)
        assert (await client.put("/admin/users/bob/tier", headers=alice, json={"tier": "pro"})).status_code in (200, 400)
        assert (await client.put("/admin/users/alice/tier", headers=bob, json={"tier": "pro"})).status_code == 403
        assert (await client.get("/admin/audit", headers=bob)).status_code == 403
        events = (await client.get("/admin/audit", headers=alice)).json()
        actions = [e["action"] for e in events]
        for action in ("auth.signup", "auth.login_failed", "auth.login", "auth.api_key_created",
                       "auth.api_key_revoked", "admin.put"):
            assert action in actions, (action, actions)
        failed = next(e for e in events if e["action"] == "auth.login_failed")
        assert failed["actor_name"] == "bob" and failed["address"] and failed["at"] and failed["status"] == 401
        admin_puts = [e for e in events if e["action"] == "admin.put"]
        refused = next(e for e in admin_puts if e["actor_name"] == "bob")
        assert refused["status"] == 403 and refused["target"] == "/admin/users/alice/tier"
        done = next(e for e in admin_puts if e["actor_name"] == "alice")
        assert '"tier"' in done["detail"]["body"]
        only_auth = (await client.get("/admin/audit", headers=alice, params={"action": "auth."})).json()
        assert only_auth and all(e["action"].startswith("auth.") for e in only_auth)


async def test_security_headers_on_every_answer(tmp_path, tiny_backend):
    async with app_client(_settings(tmp_path), tiny_backend) as (client, app, alice):
        for r in (await client.get("/healthz"), await client.get("/auth/me", headers=alice),
                  await client.get("/auth/me")):
            assert r.headers["x-content-type-options"] == "nosniff"
            assert r.headers["x-frame-options"] == "DENY"
            assert r.headers["referrer-policy"] == "no-referrer"
            assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
            assert "strict-transport-security" not in r.headers  # plain HTTP
        page = await client.get("/")
        assert "script-src 'self'" in page.headers["content-security-policy"]  # the app's own policy stays
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="https://test") as tls:
            assert (await tls.get("/healthz")).headers["strict-transport-security"].startswith("max-age=31536000")
        # No CORS unless origins are named.
        r = await client.options("/v1/models", headers={"Origin": "https://evil.example",
                                                        "Access-Control-Request-Method": "GET"})
        assert "access-control-allow-origin" not in r.headers


async def test_cors_only_for_the_configured_origins(tmp_path, tiny_backend):
    settings = make_settings(tmp_path, server={"cors_origins": ["https://chat.example.com"]})
    async with app_client(settings, tiny_backend) as (client, _app, alice):
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        r = await client.options("/v1/chat/completions", headers={"Origin": "https://chat.example.com", **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://chat.example.com"
        r = await client.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
        assert "access-control-allow-origin" not in r.headers
        r = await client.get("/auth/me", headers={"Origin": "https://chat.example.com", **alice})
        assert r.headers["access-control-allow-origin"] == "https://chat.example.com"


@pytest.mark.parametrize("origin", ["*", "chat.example.com", "https://chat.example.com/app", "ftp://x.org"])
def test_a_bad_cors_origin_is_refused_at_start(origin):
    with pytest.raises(ValueError, match="cors_origins"):
        Settings(server={"cors_origins": [origin]})


def test_log_redaction_removes_each_kind_of_secret():
    from chatloom.app.core.log_redaction import redact
    key = "cl-" + "A1b2C3d4" * 5
    jwt_token = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1c3IifQ.c2lnbmF0dXJl"
    cases = [f"Bearer {key}", f"x-api-key={key}", f"authorization: Bearer {jwt_token}", f"GET /s/{'x' * 43} HTTP/1.1",
             "GET /auth/sso/callback?code=abc123&state=def456 HTTP/1.1", '{"password": "hunter2"}']
    for line in cases:
        cleaned = redact(line)
        for secret in (key, jwt_token, "x" * 43, "abc123", "def456", "hunter2"):
            assert secret not in cleaned, (line, cleaned)
    assert redact("GET /v1/models HTTP/1.1 200") == "GET /v1/models HTTP/1.1 200"
