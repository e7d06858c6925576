"""Accounts: sign-up, login, tokens, API keys; every route needs one of them."""
from __future__ import annotations

import time

import jwt
from sqlalchemy import select

from chatloom.store import ApiKey

from app_testing import signup


async def test_signup_login_and_first_user_is_admin(client):
    r = await client.post("/auth/signup", json={"username": "alice", "password": "correct horse"})
    assert r.status_code == 201
    assert r.json()["user"]["is_admin"] is True and r.json()["user"]["tier"] == "free"
    r = await client.post("/auth/signup", json={"username": "bob", "password": "battery staple"})
    assert r.json()["user"]["is_admin"] is False

    r = await client.post("/auth/login", json={"username": "bob", "password": "battery staple"})
    assert r.status_code == 200
    me = await client.get("/auth/me", headers={"Authorization": f"Bearer {r.json()['token']}"})
    assert me.json()["username"] == "bob"


async def test_duplicate_username_and_wrong_password(client, alice):
    r = await client.post("/auth/signup", json={"username": "alice", "password": "another one"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "username_taken"
    for body in ({"username": "alice", "password": "wrong password"}, {"username": "nobody", "password": "x"}):
        r = await client.post("/auth/login", json=body)
        assert r.status_code == 401
        assert r.json()["error"]["message"] == "wrong username or password"


async def test_signup_validation(client):
    for body in ({"username": "al", "password": "long enough"}, {"username": "alice", "password": "short"},
                 {"username": "a b c", "password": "long enough"}, {"username": "alice"}):
        r = await client.post("/auth/signup", json=body)
        assert r.status_code == 422, body
        assert r.json()["error"]["param"] in ("username", "password")


async def test_every_route_needs_a_credential(client, alice):
    routes = [("GET", "/conversations"), ("POST", "/conversations"), ("GET", "/conversations/conv_x"),
              ("POST", "/conversations/conv_x/messages"), ("GET", "/auth/api-keys"), ("GET", "/v1/models"),
              ("POST", "/v1/chat/completions")]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer nonsense"}, {"Authorization": "Basic abc"},
                        {"Authorization": "Bearer cl-not-a-real-key"}):
            r = await client.request(method, path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"


async def test_expired_token_is_refused(client, app, alice):
    me = (await client.get("/auth/me", headers=alice)).json()
    secret = app.state.ctx.settings.accounts.jwt_secret
    old = jwt.encode({"sub": me["id"], "iat": 0, "exp": int(time.time()) - 10}, secret, "HS256")
    r = await client.get("/conversations", headers={"Authorization": f"Bearer {old}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"


async def test_api_keys_create_use_list_revoke(client, app, alice):
    r = await client.post("/auth/api-keys", headers=alice, json={"name": "laptop"})
    assert r.status_code == 201
    key_id, key = r.json()["id"], r.json()["key"]
    by_key = {"Authorization": f"Bearer {key}"}
    assert (await client.get("/conversations", headers=by_key)).status_code == 200

    listed = (await client.get("/auth/api-keys", headers=alice)).json()
    assert [k["id"] for k in listed] == [key_id]
    assert "key" not in listed[0] and key.startswith(listed[0]["prefix"])
    async with app.state.ctx.db.session() as s:  # only a hash is stored
        row = await s.scalar(select(ApiKey).where(ApiKey.id == key_id))
        assert row.key_hash != key and key not in row.key_hash

    # Another user can neither see nor revoke it.
    bob = await signup(client, "bob")
    assert (await client.get("/auth/api-keys", headers=bob)).json() == []
    assert (await client.delete(f"/auth/api-keys/{key_id}", headers=bob)).status_code == 404

    assert (await client.delete(f"/auth/api-keys/{key_id}", headers=alice)).status_code == 204
    assert (await client.get("/conversations", headers=by_key)).status_code == 401
    assert (await client.delete(f"/auth/api-keys/{key_id}", headers=alice)).status_code == 404
