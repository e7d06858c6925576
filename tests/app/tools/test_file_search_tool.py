"""file_search in the chat: the model searches the user's files with a query of its own, the passages
come back numbered after those the prompt already cites, and the answer's citations hold both, in the
automatic retrieval's shape. Another user's collection is never searched; the setting turns it off."""
from __future__ import annotations

from app_testing import (ToolCallingBackend, app_client, call_text, done_of, make_settings, new_conversation,
                         send, signup)

ZOO = ("# The zoo\n\nThe zebra quagga lives on the savanna and eats grass all day. " * 3).encode()
BOATS = ("Notes on boats and the zoo ferry: the ferry leaves at nine and carries bicycles. " * 3).encode()
SECRET = ("Bob's diary: the quagga password is swordfish. " * 3).encode()


async def _upload(client, headers, name: str, data: bytes, **form) -> str:
    r = await client.post("/files", headers=headers, files={"file": (name, data)}, data=form)
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def _collection(client, headers, name: str) -> str:
    r = await client.post("/collections", headers=headers, json={"name": name})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _result(events) -> dict:
    return next(e.data["tool_result"] for e in events if isinstance(e.data, dict) and "tool_result" in e.data)


async def test_passages_come_back_numbered_after_the_prompts_and_are_cited(tmp_path, db_url):
    backend = ToolCallingBackend()
    settings = make_settings(tmp_path, server={"db_url": db_url}, sampling={"max_tokens": 2000})
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        zoo = await _collection(client, alice, "zoo")
        zoo_file = await _upload(client, alice, "zoo.md", ZOO, collection_id=zoo)
        boats = await _upload(client, alice, "boats.txt", BOATS, conversation_id=cid)
        _, events = await send(client, alice, cid, call_text("file_search", query="zebra quagga", collection="zoo"))
        system = backend.requests[-1].messages[0]["content"]
        assert '"file_search"' in system and "The user's collections: zoo." in system
        result = _result(events)
        assert result["error"] is None and result["output"].startswith("[2] zoo.md:\n# The zoo")
        done = done_of(events)
        # [1]: boats.txt, retrieved for the prompt (the message names the zoo); [2]: the tool's passage.
        assert [(c["n"], c["file_id"]) for c in done["citations"]] == [(1, boats), (2, zoo_file)]
        assert set(done["citations"][1]) == set(done["citations"][0])  # the same shape
        assert "[2] zoo.md" in "".join(e.data.get("token", "") for e in events if isinstance(e.data, dict))
        detail = (await client.get(f"/conversations/{cid}", headers=alice)).json()
        answer = next(m for m in detail["messages"] if m["id"] == done["message_id"])
        assert answer["citations"] == done["citations"]
        whole = (await client.get(f"/files/{zoo_file}/text", headers=alice)).json()["text"]
        cite = done["citations"][1]
        assert whole[cite["char_start"]:cite["char_end"]] == cite["text"]

        # Without a collection named: the conversation's own files; a passage cited already keeps its number.
        _, events = await send(client, alice, cid, call_text("file_search", query="ferry bicycles"))
        assert _result(events)["output"].startswith("[1] boats.txt:\n")
        assert [c["n"] for c in done_of(events)["citations"]] == [1]


async def test_another_users_collection_is_never_searched(tmp_path, db_url):
    settings = make_settings(tmp_path, server={"db_url": db_url}, sampling={"max_tokens": 2000})
    async with app_client(settings, ToolCallingBackend()) as (client, app, alice):
        bob = await signup(client, "bob")
        secret = await _collection(client, bob, "diary")
        await _upload(client, bob, "diary.txt", SECRET, collection_id=secret)
        await _upload(client, alice, "zoo.md", ZOO)
        cid = await new_conversation(client, alice)
        for named in (secret, "diary"):
            _, events = await send(client, alice, cid, call_text("file_search", query="quagga password",
                                                                 collection=named))
            result = _result(events)
            assert result["error"] == f"the user has no collection named {named!r}" and not result["output"]
            assert "swordfish" not in str(events) and "citations" not in done_of(events)
        # Nothing attached: all of alice's files, none of bob's.
        _, events = await send(client, alice, cid, call_text("file_search", query="quagga password"))
        assert _result(events)["output"].startswith("[1] zoo.md:") and "swordfish" not in str(events)


async def test_offered_only_with_files_and_the_setting_on(tmp_path):
    backend = ToolCallingBackend()
    async with app_client(make_settings(tmp_path), backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        await send(client, alice, cid, "hello")
        assert "<tools>" not in backend.requests[-1].messages[0]["content"]  # no files: no tool
        await _upload(client, alice, "zoo.md", ZOO)
        await send(client, alice, cid, "hello")
        assert '"file_search"' in backend.requests[-1].messages[0]["content"]
    backend = ToolCallingBackend()
    async with app_client(make_settings(tmp_path / "off", files={"search_tool": False}), backend) as (
            client, app, alice):
        cid = await new_conversation(client, alice)
        await _upload(client, alice, "zoo.md", ZOO)
        await send(client, alice, cid, "hello")
        assert "<tools>" not in backend.requests[-1].messages[0]["content"]
