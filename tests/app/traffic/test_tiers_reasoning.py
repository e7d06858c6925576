"""Tiers from defaults, a file and the environment; `chatloom users set-tier`; the reasoning class."""
from __future__ import annotations

import httpx
import pytest

from chatloom.app.main import create_app
from chatloom.app.traffic.reasoning import ThinkingSplitter, cap_effort
from chatloom.app.traffic.tiers import TierTable
from chatloom.cli.main import main as cli_main

from app_testing import make_settings, new_conversation, parse_sse, signup, tokens_of
from traffic_testing import ScriptedBackend, write_tiers


def test_tiers_from_defaults_file_and_environment(tmp_path):
    table = TierTable.load(env={})
    assert table.names() == ["free", "plus", "pro"] and table.for_user(None).name == "free"
    assert table.for_user("gone").name == "free"  # a tier removed from the config falls back
    path = write_tiers(tmp_path, free={"tokens_per_minute": 123}, team={"priority": 5, "models": ["a", "b"]})
    table = TierTable.load(path, env={"CHATLOOM_TIER_FREE_TOKENS_PER_DAY": "999",
                                      "CHATLOOM_TIER_TEAM_MAX_TOKENS": "77"})
    assert table["free"].tokens_per_minute == 123 and table["free"].tokens_per_day == 999
    assert table["team"].priority == 5 and table["team"].models == ("a", "b") and table["team"].max_tokens == 77
    assert table["team"].allows_model("a") and not table["team"].allows_model("c")
    with pytest.raises(ValueError, match="unknown field"):
        TierTable.load(env={"CHATLOOM_TIER_FREE_COLOUR": "red"})
    with pytest.raises(ValueError, match="must be a number"):
        TierTable.load(env={"CHATLOOM_TIER_PRO_PRIORITY": "high"})


def test_cli_set_tier(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    assert cli_main(["keys", "create", "--user", "carol", "--create-user", "--db", db]) == 0
    assert cli_main(["users", "set-tier", "carol", "pro", "--db", db]) == 0
    assert "carol: tier pro" in capsys.readouterr().out
    assert cli_main(["users", "set-tier", "carol", "gold", "--db", db]) == 2
    assert cli_main(["users", "set-tier", "nobody", "pro", "--db", db]) == 2
    assert "no user named 'nobody'" in capsys.readouterr().err


def test_thinking_splitter_handles_tags_split_across_pieces():
    s = ThinkingSplitter()
    out = []
    for piece in ["<th", "ink>First", " idea.</th", "ink>\nThe", " answer."]:
        out += s.push(piece)
    out += s.finish()
    thinking = "".join(t for k, t in out if k == "thinking")
    answer = "".join(t for k, t in out if k == "answer")
    assert thinking == "First idea." and answer == "The answer."
    plain = ThinkingSplitter()
    assert plain.push("No tags") + plain.finish() == [("answer", "No tags")]
    assert cap_effort("high", "low") == "low" and cap_effort("low", "high") == "low"


async def test_reasoning_streams_thinking_apart_from_the_answer(tmp_path):
    backend = ScriptedBackend(["<think>", "Two", " plus", " two.", "</think>", "Four", "."])
    app = create_app(make_settings(tmp_path, moderation={"mode": "off"}), backend)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            alice = await signup(c, "alice")
            cid = await new_conversation(c, alice)
            r = await c.post(f"/conversations/{cid}/messages", headers=alice,
                             json={"text": "2+2?", "reasoning_effort": "medium", "max_tokens": 20})
            events = parse_sse(r.text)
            thinking = "".join(e.data["thinking"] for e in events if "thinking" in e.data)
            assert thinking == "Two plus two." and tokens_of(events) == "Four."
            request = backend.requests[-1]
            assert "<think>" in request.messages[0]["content"]  # the instructions are in the system prompt
            assert request.max_tokens > 20  # room for the thinking on top of the answer
            conv = (await c.get(f"/conversations/{cid}", headers=alice)).json()
            assert conv["messages"][-1]["text"] == "Four."  # the thinking is not the answer

            # The operator caps the dial under load.
            r = await c.put("/admin/reasoning", headers=alice, json={"max_effort": "low"})
            assert r.status_code == 200
            r = await c.post("/v1/chat/completions", headers=alice, json={
                "model": "scripted", "reasoning_effort": "high", "max_tokens": 20,
                "messages": [{"role": "user", "content": "2+2?"}]})
            msg = r.json()["choices"][0]["message"]
            assert msg["content"] == "Four." and msg["reasoning_content"] == "Two plus two."
            assert "about 192 words" in backend.requests[-1].messages[0]["content"]  # low: 256 tokens
            assert (await c.put("/admin/reasoning", headers=alice, json={"max_effort": "max"})).status_code == 422
            r = await c.post(f"/conversations/{cid}/messages", headers=alice,
                             json={"text": "x", "reasoning_effort": "extreme"})
            assert r.status_code == 422
