"""Editing (a new user sibling via parent_id) and regenerating (a new assistant sibling), then
reading either branch back with ?leaf=."""
from __future__ import annotations

from app_testing import done_of, new_conversation, parse_sse, send


async def read(client, headers, cid, leaf=None) -> dict:
    r = await client.get(f"/conversations/{cid}", headers=headers, params={"leaf": leaf} if leaf else None)
    assert r.status_code == 200, r.text
    return r.json()


async def test_edit_and_regenerate_then_read_both_branches(client, alice):
    cid = await new_conversation(client, alice)
    await send(client, alice, cid, "What is a good name for a cat?")
    await send(client, alice, cid, "Something shorter please")
    original = await read(client, alice, cid)
    q1, a1, q2, a2 = original["messages"]

    # Edit the second question: same parent (a1), new text.
    _, events = await send(client, alice, cid, "Something longer please", parent_id=a1["id"])
    edited = await read(client, alice, cid)
    assert [m["id"] for m in edited["messages"][:2]] == [q1["id"], a1["id"]]
    q2b, a2b = edited["messages"][2:]
    assert q2b["text"] == "Something longer please" and q2b["parent_id"] == a1["id"]
    assert q2b["sibling_ids"] == [q2["id"], q2b["id"]] and q2b["sibling_index"] == 1
    assert done_of(events)["message_id"] == a2b["id"]

    # Regenerate the first answer: a new assistant sibling under q1; the branch below a1 stays reachable.
    r = await client.post(f"/conversations/{cid}/messages/{a1['id']}/regenerate", headers=alice,
                          json={"max_tokens": 5})
    assert r.status_code == 200
    regen_done = done_of(parse_sse(r.text))
    assert regen_done["user_message_id"] == q1["id"] and regen_done["usage"]["completion_tokens"] == 5
    latest = await read(client, alice, cid)
    assert [m["id"] for m in latest["messages"]] == [q1["id"], regen_done["message_id"]]
    assert latest["messages"][1]["sibling_ids"] == [a1["id"], regen_done["message_id"]]

    # ?leaf= selects a branch; a non-leaf id extends down its newest children.
    old_branch = await read(client, alice, cid, leaf=a2["id"])
    assert [m["id"] for m in old_branch["messages"]] == [q1["id"], a1["id"], q2["id"], a2["id"]]
    assert old_branch["messages"][2]["sibling_ids"] == [q2["id"], q2b["id"]]
    via_a1 = await read(client, alice, cid, leaf=a1["id"])
    assert [m["id"] for m in via_a1["messages"]] == [q1["id"], a1["id"], q2b["id"], a2b["id"]]

    # A follow-up without parent_id continues the branch shown by default (the regenerated one).
    _, events = await send(client, alice, cid, "And one more?")
    final = await read(client, alice, cid)
    assert [m["id"] for m in final["messages"][:2]] == [q1["id"], regen_done["message_id"]]
    assert len(final["messages"]) == 4


async def test_edit_the_first_message(client, alice):
    cid = await new_conversation(client, alice)
    await send(client, alice, cid, "first try")
    await send(client, alice, cid, "second try", parent_id=None)
    conv = await read(client, alice, cid)
    first = conv["messages"][0]
    assert first["text"] == "second try" and first["parent_id"] is None and len(first["sibling_ids"]) == 2
    assert conv["title"] == "first try"


async def test_regenerate_answers_a_user_message_too(client, alice):
    cid = await new_conversation(client, alice)
    await send(client, alice, cid, "question")
    q = (await read(client, alice, cid))["messages"][0]
    r = await client.post(f"/conversations/{cid}/messages/{q['id']}/regenerate", headers=alice)
    assert r.status_code == 200
    conv = await read(client, alice, cid)
    assert len(conv["messages"][1]["sibling_ids"]) == 2


async def test_bad_parents_and_leaves(client, alice):
    cid = await new_conversation(client, alice)
    other = await new_conversation(client, alice)
    await send(client, alice, cid, "here")
    await send(client, alice, other, "there")
    q_other = (await read(client, alice, other))["messages"][0]["id"]
    q_here, a_here = [m["id"] for m in (await read(client, alice, cid))["messages"]]

    r = await client.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "x", "parent_id": q_other})
    assert r.status_code == 400 and r.json()["error"]["param"] == "parent_id"
    r = await client.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "x", "parent_id": q_here})
    assert r.status_code == 400 and "assistant" in r.json()["error"]["message"]
    r = await client.post(f"/conversations/{cid}/messages/{q_other}/regenerate", headers=alice)
    assert r.status_code == 404 and r.json()["error"]["message"] == "message not found"
    r = await client.get(f"/conversations/{cid}", headers=alice, params={"leaf": q_other})
    assert r.status_code == 404 and r.json()["error"]["param"] == "leaf"
    # Nothing was written by the refused requests.
    conv = await read(client, alice, cid)
    assert [m["id"] for m in conv["messages"]] == [q_here, a_here]
    assert conv["messages"][0]["sibling_ids"] == [q_here]
