"""Shared links: a copy of one branch as it was, readable without an account, revocable; nothing else of
the conversation (later messages, other branches) reads through it."""
from __future__ import annotations

from app_testing import new_conversation, send


async def branch(client, headers, cid) -> list[dict]:
    r = await client.get(f"/conversations/{cid}", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["messages"]


async def test_a_link_shows_the_branch_as_shared_and_nothing_else(client, alice):
    cid = await new_conversation(client, alice, title="Cats")
    await send(client, alice, cid, "first question about cats")
    q1, a1 = await branch(client, alice, cid)
    await send(client, alice, cid, "a private aside on another branch")
    # An edit of the second question: the active branch is now q1, a1, q2b, a2b.
    await send(client, alice, cid, "second question, edited", parent_id=a1["id"])

    r = await client.post(f"/conversations/{cid}/shares", headers=alice)
    assert r.status_code == 201, r.text
    link = r.json()
    assert len(link["token"]) >= 40 and link["url"] == f"/s/{link['token']}" and link["message_count"] == 4
    await send(client, alice, cid, "a later secret written after sharing")

    shared = await client.get(f"/shared/{link['token']}")  # no Authorization header
    assert shared.status_code == 200, shared.text
    body = shared.json()
    assert set(body) == {"title", "created", "messages"} and body["title"] == "Cats"
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "assistant"]
    assert body["messages"][0]["text"] == "first question about cats"
    assert body["messages"][2]["text"] == "second question, edited"
    assert all(set(m) == {"role", "text", "created"} for m in body["messages"])
    assert "private aside" not in shared.text and "later secret" not in shared.text
    assert cid not in shared.text and q1["id"] not in shared.text

    # Up to a chosen message: only the path from the root to it.
    r = await client.post(f"/conversations/{cid}/shares", headers=alice, json={"message_id": a1["id"]})
    assert r.status_code == 201, r.text
    upto = (await client.get(f"/shared/{r.json()['token']}")).json()
    assert [m["text"] for m in upto["messages"]][:1] == ["first question about cats"]
    assert len(upto["messages"]) == 2 and r.json()["upto_message_id"] == a1["id"]

    listed = await client.get("/shares", headers=alice)
    assert [s["id"] for s in listed.json()] == [r.json()["id"], link["id"]]

    page = await client.get(f"/s/{link['token']}")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "shared.js" in page.text

    assert (await client.delete(f"/shares/{link['id']}", headers=alice)).status_code == 204
    gone = await client.get(f"/shared/{link['token']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "shared_conversation_not_found"
    assert [s["id"] for s in (await client.get("/shares", headers=alice)).json()] == [r.json()["id"]]


async def test_other_users_ids_and_bad_input_are_refused(client, alice, bob):
    cid = await new_conversation(client, alice)
    r = await client.post(f"/conversations/{cid}/shares", headers=alice)
    assert r.status_code == 400 and r.json()["error"]["code"] == "empty_conversation"
    await send(client, alice, cid, "hello")
    link = (await client.post(f"/conversations/{cid}/shares", headers=alice)).json()

    assert (await client.post(f"/conversations/{cid}/shares", headers=bob)).status_code == 404
    assert (await client.delete(f"/shares/{link['id']}", headers=bob)).status_code == 404
    assert (await client.get("/shares", headers=bob)).json() == []
    assert (await client.get("/shares")).status_code == 401
    r = await client.post(f"/conversations/{cid}/shares", headers=alice, json={"message_id": "msg_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "message_id"
    r = await client.post(f"/conversations/{cid}/shares", headers=alice, json={"message": "x"})
    assert r.status_code == 422
    assert (await client.get("/shared/not-a-real-token")).status_code == 404
    assert (await client.get("/shared/" + "x" * 65)).status_code == 422

    # Deleting the conversation ends its links.
    assert (await client.delete(f"/conversations/{cid}", headers=alice)).status_code == 204
    assert (await client.get(f"/shared/{link['token']}")).status_code == 404
