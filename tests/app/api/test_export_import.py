"""Export (JSON with every branch, Markdown of the active branch) and import (our own export, ChatGPT's
conversations.json): trees, roles and timestamps survive; bad files are refused whole."""
from __future__ import annotations

import io
import json
import zipfile

from sqlalchemy import func, select

from app_testing import new_conversation, send
from chatloom.store import Conversation, Message


def chatgpt_export() -> list[dict]:
    """A small conversations.json as ChatGPT writes it: a hidden system root, an edited question (two
    branches), a tool node between two assistant turns, an image part."""
    def node(key, parent, children, role=None, parts=None, t=None):
        message = None if role is None else {"id": key, "author": {"role": role}, "create_time": t,
                                             "content": {"content_type": "text", "parts": parts},
                                             "metadata": {"model_slug": "gpt-4o"} if role == "assistant" else {}}
        return {"id": key, "message": message, "parent": parent, "children": children}

    mapping = {
        "root": node("root", None, ["sys"]),
        "sys": node("sys", "root", ["q1", "q1b"], "system", [""], 1700000000.0),
        "q1": node("q1", "sys", ["a1"], "user", ["What is 2+2?"], 1700000001.0),
        "a1": node("a1", "q1", [], "assistant", ["4"], 1700000002.0),
        "q1b": node("q1b", "sys", ["tool"], "user", ["What is 3+3?", {"asset_pointer": "file-1"}], 1700000010.0),
        "tool": node("tool", "q1b", ["a1b"], "tool", ["calc: 6"], 1700000011.0),
        "a1b": node("a1b", "tool", [], "assistant", ["It is 6."], 1700000012.0),
    }
    return [{"title": "Arithmetic", "create_time": 1700000000.0, "update_time": 1700000012.0,
             "mapping": mapping, "current_node": "a1b"}]


async def read(client, headers, cid, leaf=None) -> dict:
    r = await client.get(f"/conversations/{cid}", headers=headers, params={"leaf": leaf} if leaf else None)
    assert r.status_code == 200, r.text
    return r.json()


async def test_export_then_import_keeps_every_branch(client, alice, bob):
    cid = await new_conversation(client, alice, title="Two branches")
    await send(client, alice, cid, "first question")
    q1, a1 = (await read(client, alice, cid))["messages"]
    await send(client, alice, cid, "second question")
    await send(client, alice, cid, "second question, edited", parent_id=a1["id"])

    r = await client.get(f"/conversations/{cid}/export", headers=alice)
    assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
    exported = r.json()
    assert exported["format"] == "chatloom.conversations" and exported["version"] == 1
    [conv] = exported["conversations"]
    assert len(conv["messages"]) == 6 and conv["title"] == "Two branches"

    md = await client.get(f"/conversations/{cid}/export", headers=alice, params={"format": "markdown"})
    assert md.status_code == 200 and md.headers["content-type"].startswith("text/markdown")
    assert "# Two branches" in md.text and "second question, edited" in md.text
    assert "second question\n" not in md.text  # the other branch is not in the Markdown

    everything = (await client.get("/conversations/export", headers=alice)).json()
    assert [c["id"] for c in everything["conversations"]] == [cid]

    # Bob imports Alice's export: a new conversation of his, same tree, roles, texts and times.
    r = await client.post("/conversations/import", headers={**bob, "Content-Type": "application/json"},
                          content=json.dumps(exported))
    assert r.status_code == 201, r.text
    out = r.json()
    assert out["format"] == "chatloom" and out["messages"] == 6 and len(out["conversation_ids"]) == 1
    new_cid = out["conversation_ids"][0]
    assert new_cid != cid
    again = (await client.get(f"/conversations/{new_cid}/export", headers=bob)).json()["conversations"][0]
    assert again["title"] == "Two branches"

    def shape(c):  # the tree by position, independent of ids
        index = {m["id"]: i for i, m in enumerate(c["messages"])}
        return [(index.get(m["parent_id"]), m["role"], m["text"], m["created"]) for m in c["messages"]]

    assert shape(again) == shape(conv)
    active = await read(client, bob, new_cid)
    assert [m["text"] for m in active["messages"]][::2] == ["first question", "second question, edited"]
    assert (await client.get(f"/conversations/{new_cid}", headers=alice)).status_code == 404
    assert (await client.get(f"/conversations/{cid}/export", headers=bob)).status_code == 404


async def test_chatgpt_export_keeps_the_tree_roles_and_times(client, alice):
    r = await client.post("/conversations/import", headers={**alice, "Content-Type": "application/json"},
                          content=json.dumps(chatgpt_export()))
    assert r.status_code == 201, r.text
    assert r.json()["format"] == "chatgpt" and r.json()["messages"] == 4
    cid = r.json()["conversation_ids"][0]
    conv = (await client.get(f"/conversations/{cid}/export", headers=alice)).json()["conversations"][0]
    assert conv["title"] == "Arithmetic" and conv["created"] == "2023-11-14T22:13:20Z"
    by_text = {m["text"]: m for m in conv["messages"]}
    assert set(by_text) == {"What is 2+2?", "4", "What is 3+3?", "It is 6."}
    # The system root and the tool node are left out; what hung from them hangs from their nearest kept parent.
    assert by_text["What is 2+2?"]["parent_id"] is None and by_text["What is 3+3?"]["parent_id"] is None
    assert by_text["It is 6."]["parent_id"] == by_text["What is 3+3?"]["id"]
    assert by_text["4"]["role"] == "assistant" and by_text["4"]["model"] == "gpt-4o"
    assert by_text["4"]["created"] == "2023-11-14T22:13:22Z"
    active = await read(client, alice, cid)  # current_node: the second branch
    assert [m["text"] for m in active["messages"]] == ["What is 3+3?", "It is 6."]
    assert active["messages"][0]["sibling_ids"] == [by_text["What is 2+2?"]["id"], by_text["What is 3+3?"]["id"]]


async def count_rows(app) -> tuple[int, int]:
    async with app.state.ctx.db.session() as s:
        return (await s.scalar(select(func.count()).select_from(Conversation)),
                await s.scalar(select(func.count()).select_from(Message)))


async def test_bad_files_are_refused_and_store_nothing(app, client, alice):
    h = {**alice, "Content-Type": "application/json"}
    good = chatgpt_export()[0]
    broken_parent = json.loads(json.dumps(good))
    broken_parent["mapping"]["a1"]["parent"] = "missing"
    ours = {"format": "chatloom.conversations", "version": 1, "exported": None, "conversations": [
        {"id": "c", "title": "t", "created": "2024-01-01T00:00:00Z", "updated": None, "current_leaf_id": None,
         "messages": [{"id": "m1", "parent_id": "m2", "role": "user", "text": "a", "created": "2024-01-01T00:00:00Z"},
                      {"id": "m2", "parent_id": "m1", "role": "assistant", "text": "b",
                       "created": "2024-01-01T00:00:01Z"}]}]}
    bad_role = json.loads(json.dumps(ours))
    bad_role["conversations"][0]["messages"] = [{"id": "m1", "parent_id": None, "role": "wizard", "text": "a",
                                                 "created": "2024-01-01T00:00:00Z"}]
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:  # ChatGPT's data export as downloaded, not the file inside it
        z.writestr("conversations.json", json.dumps(chatgpt_export()))
    cases = {
        b"this is not json": "not JSON",
        archive.getvalue(): "a ZIP archive (ChatGPT's data export is one: import the conversations.json inside it)",
        b"%PDF-1.4\n1 0 obj << >> endobj\n": "the file is a PDF, not JSON",
        b"\x7fELF\x02\x01\x01\x00" + bytes(64): "the file is a program, not JSON",
        b"[]": "holds no conversations",
        json.dumps({**ours, "conversations": []}).encode(): "holds no conversations",
        b'{"hello": 1}': "expected chatloom's export",
        json.dumps([good, broken_parent]).encode(): "'missing' of node 'a1' is not in the mapping",
        json.dumps(ours).encode(): "form a cycle",
        json.dumps(bad_role).encode(): "role must be user or assistant",
        json.dumps({**ours, "version": 7}).encode(): "version 7",
        json.dumps([{"mapping": {"x": {"parent": None, "message": {"author": {}, "content": {}}}}}]).encode():
            "author.role must be a string",
    }
    for body, problem in cases.items():
        r = await client.post("/conversations/import", headers=h, content=body)
        assert r.status_code == 400, (body[:60], r.text)
        assert r.json()["error"]["code"] == "invalid_import" and problem in r.json()["error"]["message"], r.text
    assert await count_rows(app) == (0, 0)  # the good first conversation of a bad file was not stored

    assert (await client.post("/conversations/import", content=b"[]")).status_code == 401
    assert (await client.get("/conversations/export", params={"format": "pdf"}, headers=alice)).status_code == 422


async def test_an_import_over_the_limit_is_413(tmp_path, tiny_backend):
    from app_testing import app_client, make_settings

    settings = make_settings(tmp_path, portability={"import_max_bytes": 2_000})
    async with app_client(settings, tiny_backend) as (client, app, alice):
        h = {**alice, "Content-Type": "application/json"}
        big = json.dumps(chatgpt_export() * 10).encode()
        r = await client.post("/conversations/import", headers=h, content=big)
        assert r.status_code == 413, r.text
        assert await count_rows(app) == (0, 0)
        ok = await client.post("/conversations/import", headers=h, content=json.dumps(chatgpt_export()))
        assert ok.status_code == 201, ok.text


async def test_text_no_column_can_hold_is_replaced_not_a_500(client, alice):
    export = chatgpt_export()
    export[0]["mapping"]["a1"]["message"]["content"]["parts"] = ["four \ud800 and \x00 and \x0c"]
    r = await client.post("/conversations/import", headers={**alice, "Content-Type": "application/json"},
                          content=json.dumps(export))
    assert r.status_code == 201, r.text
    conv = (await client.get(f"/conversations/{r.json()['conversation_ids'][0]}/export", headers=alice)).json()
    texts = [m["text"] for m in conv["conversations"][0]["messages"]]
    assert "four \ufffd and \ufffd and \x0c" in texts
