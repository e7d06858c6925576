"""Custom instructions and memories: kept per user through the API, placed in the system prompt within
the token budget; a memory the model proposes reaches the prompt only once the user confirms it."""
from __future__ import annotations

from chatloom.app.core.memory import MEMORIES_HEADER, personal_prompt

from app_testing import ToolCallingBackend, app_client, make_settings, new_conversation, send


def latest_system(backend: ToolCallingBackend) -> str:
    """The system message of the latest request."""
    return backend.requests[-1].messages[0]["content"]


def count_words(text: str) -> int:
    return len(text.split())


def test_the_budget_keeps_the_instructions_and_the_newest_memories_that_fit():
    memories = [f"fact number {i} here" for i in range(10)]
    out = personal_prompt("Answer in French.", memories, 30, count_words)
    assert count_words(out) <= 30 and "Answer in French." in out
    assert "fact number 9 here" in out and "fact number 0 here" not in out
    kept = out.split(MEMORIES_HEADER)[1].splitlines()
    assert kept == [f"- fact number {i} here" for i in range(10 - len(kept), 10)]  # oldest first, newest kept
    assert count_words(personal_prompt("word " * 100, memories, 20, count_words)) <= 20
    assert personal_prompt("", [], 20, count_words) == ""


async def test_instructions_and_memories_reach_the_prompt(tmp_path):
    backend = ToolCallingBackend()
    settings = make_settings(tmp_path, chat={"tools": "remember"}, memory={"prompt_budget_tokens": 60})
    async with app_client(settings, backend) as (client, app, alice):
        r = await client.put("/me/instructions", headers=alice, json={"text": "Call me Captain."})
        assert r.status_code == 200 and r.json() == {"text": "Call me Captain."}
        assert (await client.get("/me/instructions", headers=alice)).json()["text"] == "Call me Captain."
        m = await client.post("/memories", headers=alice, json={"text": "I keep bees."})
        assert m.status_code == 201 and m.json()["status"] == "active"
        mid = m.json()["id"]
        edited = await client.patch(f"/memories/{mid}", headers=alice, json={"text": "I keep bees and goats."})
        assert edited.status_code == 200 and edited.json()["text"] == "I keep bees and goats."

        cid = await new_conversation(client, alice)
        await send(client, alice, cid, "hello")
        system = latest_system(backend)
        assert system.startswith("Be brief.") and "Call me Captain." in system and "I keep bees and goats." in system

        # The model proposes a memory: stored as proposed, not in the prompt until confirmed.
        await send(client, alice, cid, "remember that my dog is called Rex")
        [proposed] = (await client.get("/memories", headers=alice, params={"status": "proposed"})).json()
        assert proposed["text"] == "my dog is called Rex" and proposed["source_conversation_id"] == cid
        await send(client, alice, cid, "hello again")
        assert "Rex" not in latest_system(backend)
        r = await client.post(f"/memories/{proposed['id']}/confirm", headers=alice)
        assert r.status_code == 200 and r.json()["status"] == "active"
        await send(client, alice, cid, "and again")
        assert "my dog is called Rex" in latest_system(backend)

        # Deleted: gone from the prompt; another user sees none of it and cannot touch it.
        bob = await signup_bob(client)
        assert (await client.get("/memories", headers=bob)).json() == []
        assert (await client.get("/me/instructions", headers=bob)).json() == {"text": ""}
        assert (await client.delete(f"/memories/{mid}", headers=bob)).status_code == 404
        assert (await client.patch(f"/memories/{mid}", headers=bob, json={"text": "x"})).status_code == 404
        assert (await client.post(f"/memories/{mid}/confirm", headers=bob)).status_code == 404
        assert (await client.delete(f"/memories/{mid}", headers=alice)).status_code == 204
        await send(client, alice, cid, "last one")
        assert "bees" not in latest_system(backend)
        cid_bob = await new_conversation(client, bob)
        await send(client, bob, cid_bob, "hi")
        assert "Captain" not in latest_system(backend) and "Rex" not in latest_system(backend)


async def signup_bob(client) -> dict:
    from app_testing import signup
    return await signup(client, "bob")


async def test_bad_memory_input_is_refused(tmp_path):
    backend = ToolCallingBackend()
    settings = make_settings(tmp_path, memory={"max_memories": 2, "max_memory_chars": 20,
                                               "max_instructions_chars": 10})
    async with app_client(settings, backend) as (client, app, alice):
        r = await client.post("/memories", headers=alice, json={"text": "   "})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text"
        r = await client.post("/memories", headers=alice, json={"text": "x" * 21})
        assert r.status_code == 400 and "at most 20" in r.json()["error"]["message"]
        assert (await client.put("/me/instructions", headers=alice, json={"text": "y" * 11})).status_code == 400
        assert (await client.put("/me/instructions", headers=alice, json={"text": 5})).status_code == 422
        for i in range(2):
            assert (await client.post("/memories", headers=alice, json={"text": f"fact {i}"})).status_code == 201
        r = await client.post("/memories", headers=alice, json={"text": "one too many"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "too_many_memories"
        assert (await client.get("/memories", params={"status": "other"}, headers=alice)).status_code == 422
        assert (await client.get("/memories")).status_code == 401
