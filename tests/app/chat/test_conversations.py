"""The conversation API over ASGI: listing, reading, renaming, deleting, streaming answers, ownership."""
from __future__ import annotations

from sqlalchemy import func, select

from chatloom.store import Message

from app_testing import done_of, new_conversation, send, tokens_of


async def test_stream_format_and_saved_answer(client, alice):
    cid = await new_conversation(client, alice)
    r, events = await send(client, alice, cid, "Hello there, how are you?", max_tokens=12)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert [int(e.id) for e in events] == list(range(1, len(events) + 1))  # every event has an increasing id
    assert all("token" in e.data for e in events[:-1]) and len(events) >= 2
    done = done_of(events)
    assert done["message_id"] == r.headers["x-message-id"]
    assert done["finish_reason"] == "length"  # the tiny random model runs to max_tokens at temperature 0
    assert done["usage"]["completion_tokens"] == 12 and done["usage"]["prompt_tokens"] > 0

    conv = (await client.get(f"/conversations/{cid}", headers=alice)).json()
    assert conv["title"] == "Hello there, how are you?"
    user, answer = conv["messages"]
    assert (user["role"], user["text"], user["parent_id"]) == ("user", "Hello there, how are you?", None)
    assert user["tokens"] == len("Hello there, how are you?")  # byte-level tokenizer
    assert answer["role"] == "assistant" and answer["parent_id"] == user["id"]
    assert answer["text"] == tokens_of(events)
    assert answer["status"] == "incomplete" and answer["finish_reason"] == "length"
    assert answer["model"] == "tiny-random" and answer["sibling_ids"] == [answer["id"]]


async def test_follow_up_continues_the_branch(client, alice):
    cid = await new_conversation(client, alice)
    await send(client, alice, cid, "first")
    _, events = await send(client, alice, cid, "second")
    conv = (await client.get(f"/conversations/{cid}", headers=alice)).json()
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant", "user", "assistant"]
    assert conv["messages"][2]["parent_id"] == conv["messages"][1]["id"]
    assert conv["title"] == "first"  # the title comes from the first message only
    assert done_of(events)["user_message_id"] == conv["messages"][2]["id"]


async def test_list_newest_first_with_pagination(client, alice):
    ids = [await new_conversation(client, alice, title=f"c{i}") for i in range(5)]
    listed = (await client.get("/conversations", headers=alice)).json()
    assert [c["id"] for c in listed] == ids[::-1]
    assert set(listed[0]) == {"id", "title", "updated", "created"}
    page = (await client.get("/conversations?limit=2&offset=1", headers=alice)).json()
    assert [c["id"] for c in page] == ids[::-1][1:3]
    # Writing to an old conversation moves it to the top.
    await send(client, alice, ids[0], "bump")
    assert (await client.get("/conversations?limit=1", headers=alice)).json()[0]["id"] == ids[0]


async def test_rename(client, alice):
    cid = await new_conversation(client, alice)
    assert (await client.get(f"/conversations/{cid}", headers=alice)).json()["title"] == "New chat"
    r = await client.patch(f"/conversations/{cid}", headers=alice, json={"title": "  Trip plans "})
    assert r.status_code == 200 and r.json()["title"] == "Trip plans"
    await send(client, alice, cid, "this does not rename it")
    assert (await client.get(f"/conversations/{cid}", headers=alice)).json()["title"] == "Trip plans"
    r = await client.patch(f"/conversations/{cid}", headers=alice, json={"title": "   "})
    assert r.status_code == 422


async def test_delete_removes_messages_for_real(client, app, alice):
    cid = await new_conversation(client, alice)
    await send(client, alice, cid, "remember this")
    assert (await client.delete(f"/conversations/{cid}", headers=alice)).status_code == 204
    assert (await client.get(f"/conversations/{cid}", headers=alice)).status_code == 404
    assert (await client.get("/conversations", headers=alice)).json() == []
    async with app.state.ctx.db.session() as s:
        assert await s.scalar(select(func.count()).select_from(Message)) == 0
    assert (await client.delete(f"/conversations/{cid}", headers=alice)).status_code == 404


async def test_another_users_conversation_is_404(client, alice, bob):
    cid = await new_conversation(client, alice)
    await send(client, alice, cid, "private")
    msg = (await client.get(f"/conversations/{cid}", headers=alice)).json()["messages"][1]["id"]
    attempts = [("GET", f"/conversations/{cid}", None), ("PATCH", f"/conversations/{cid}", {"title": "mine"}),
                ("DELETE", f"/conversations/{cid}", None), ("POST", f"/conversations/{cid}/messages", {"text": "hi"}),
                ("POST", f"/conversations/{cid}/messages/{msg}/regenerate", None),
                ("POST", f"/conversations/{cid}/stop", None)]
    for method, path, body in attempts:
        r = await client.request(method, path, headers=bob, json=body)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["message"] == "conversation not found"
    assert (await client.get("/conversations", headers=bob)).json() == []
    conv = (await client.get(f"/conversations/{cid}", headers=alice)).json()
    assert conv["title"] == "private" and len(conv["messages"]) == 2


async def test_stop_without_a_running_answer(client, alice):
    cid = await new_conversation(client, alice)
    r = await client.post(f"/conversations/{cid}/stop", headers=alice)
    assert r.status_code == 200 and r.json() == {"stopped": False, "message_id": None}


async def test_health_endpoints(client):
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    r = await client.get("/readyz")
    assert r.status_code == 200 and r.json()["models"] == ["tiny-random"]


async def test_admin_stats_for_admins_only(client, alice, bob):
    r = await client.get("/admin/stats", headers=alice)
    assert r.status_code == 200 and "kv_cache_free_blocks" in r.json()["backend"]
    assert (await client.get("/admin/stats", headers=bob)).status_code == 403
