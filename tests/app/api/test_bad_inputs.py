"""Bad input gets a 4xx JSON error that names the problem, never a 500, and writes nothing."""
from __future__ import annotations

import pytest
from sqlalchemy import func, select

from chatloom.store import Conversation, Message

from app_testing import app_client, make_settings, new_conversation, send


async def counts(app) -> tuple[int, int]:
    async with app.state.ctx.db.session() as s:
        return (await s.scalar(select(func.count()).select_from(Conversation)),
                await s.scalar(select(func.count()).select_from(Message)))


BAD_MESSAGE_BODIES = [
    # (raw body or json, status, code, words the message must contain)
    (b"{not json", 400, "invalid_json", "not valid JSON"),
    (b"", 422, "missing_field", "body"),
    ([1, 2], 422, "invalid_value", "valid dictionary"),
    ({}, 422, "missing_field", "text"),
    ({"text": 5}, 422, "invalid_value", "text"),
    ({"text": ["a"]}, 422, "invalid_value", "text"),
    ({"text": ""}, 422, "invalid_value", "text must not be empty"),
    ({"text": "   \n"}, 422, "invalid_value", "text must not be empty"),
    ({"text": "hi", "max_tokens": "lots"}, 422, "invalid_value", "max_tokens"),
    ({"text": "hi", "max_tokens": 0}, 422, "invalid_value", "max_tokens"),
    ({"text": "hi", "temperature": -1}, 422, "invalid_value", "temperature"),
    ({"text": "hi", "temperature": 9}, 422, "invalid_value", "temperature"),
    ({"text": "hi", "parent_id": 7}, 422, "invalid_value", "parent_id"),
    ({"text": "hi", "parentid": "x"}, 422, "invalid_value", "parentid"),
    ({"text": "hi", "model": "gpt-17"}, 400, "model_not_found", "gpt-17"),
    ({"text": "hi", "max_tokens": 100000}, 400, "invalid_value", "max_tokens"),
    ({"text": "hi", "parent_id": "msg_nope"}, 400, "invalid_parent", "msg_nope"),
    ({"text": "x" * 40_001}, 400, "message_too_long", "characters"),
]


@pytest.mark.parametrize("body,status,code,words", BAD_MESSAGE_BODIES,
                         ids=[str(i) for i in range(len(BAD_MESSAGE_BODIES))])
async def test_bad_message_bodies(client, app, alice, body, status, code, words):
    cid = await new_conversation(client, alice)
    before = await counts(app)
    kwargs = {"content": body, "headers": {**alice, "content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body, "headers": alice}
    r = await client.post(f"/conversations/{cid}/messages", **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and words in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    assert await counts(app) == before  # nothing half-written


async def test_message_longer_than_the_context_window(tmp_path, tiny_backend):
    async with app_client(make_settings(tmp_path, engine={"context_window": 128}), tiny_backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        r = await client.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "y" * 120})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "128-token context window" in r.json()["error"]["message"]
        assert await counts(app) == (1, 0)


async def test_unknown_and_malformed_ids(client, alice):
    for path in ("/conversations/conv_missing", "/conversations/x" * 3):
        r = await client.get(path, headers=alice)
        assert r.status_code == 404, path
    r = await client.get("/conversations/%00", headers=alice)  # a control character: 400 naming the path
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    r = await client.get("/conversations?limit=0", headers=alice)
    assert r.status_code == 422 and r.json()["error"]["param"] == "limit"
    r = await client.get("/conversations?offset=-1", headers=alice)
    assert r.status_code == 422
    r = await client.get("/no/such/route", headers=alice)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = await client.put("/conversations", headers=alice)
    assert r.status_code == 405 and "error" in r.json()


async def test_conversation_bodies(client, alice):
    r = await client.post("/conversations", headers=alice, json={"title": 3})
    assert r.status_code == 422 and r.json()["error"]["param"] == "title"
    r = await client.post("/conversations", headers=alice, json={"title": "t" * 201})
    assert r.status_code == 422
    cid = await new_conversation(client, alice)
    r = await client.patch(f"/conversations/{cid}", headers=alice, json={})
    assert r.status_code == 422 and r.json()["error"]["param"] == "title"


async def test_no_500_when_the_model_is_unknown_to_the_backend_on_regenerate(client, alice):
    cid = await new_conversation(client, alice)
    await send(client, alice, cid, "hi")
    answer = (await client.get(f"/conversations/{cid}", headers=alice)).json()["messages"][1]["id"]
    r = await client.post(f"/conversations/{cid}/messages/{answer}/regenerate", headers=alice,
                          json={"model": "nope"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
    r = await client.post(f"/conversations/{cid}/messages/{answer}/regenerate", headers=alice,
                          json={"max_tokens": "x"})
    assert r.status_code == 422
