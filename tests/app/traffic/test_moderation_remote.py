"""Moderation that sees through spelling games, and the pluggable remote moderator against a small
local fake of an OpenAI-compatible /v1/moderations endpoint (a real HTTP server on 127.0.0.1)."""
from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from chatloom.app.main import create_app
from chatloom.app.traffic.moderation import LexiconModerator, normalize

from app_testing import LiveServer, make_settings, new_conversation, parse_sse, signup, tokens_of
from traffic_testing import ScriptedBackend

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("text", ["I'm going to kill you", "Im gonna kill you", "I’m gonna kill you",
                                  "i'll k i l l you", "I will k.i.l.l you", "1'm g0nna k!ll u",
                                  "I am  going   to ki\u200bll you"])
async def test_spelling_games_do_not_get_a_threat_through(text):
    verdict = await LexiconModerator().check_input(text)
    assert verdict is not None and verdict.category == "violence/threat", normalize(text)


@pytest.mark.parametrize("text", ["I'm going to kill it at the concert", "Im gonna kill the process",
                                  "a b c d", "You're going to love this", "I'll hurt my back lifting that"])
async def test_ordinary_speech_still_passes(text):
    assert await LexiconModerator().check_input(text) is None


async def test_contracted_threats_are_refused_on_input_and_cut_on_output_on_both_apis(tmp_path):
    backend = ScriptedBackend(["Okay", ".", " Im", " gonna", " kill", " you", "."])
    app = create_app(make_settings(tmp_path), backend)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            alice = await signup(c, "alice")
            cid = await new_conversation(c, alice)
            r = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "I'm going to kill you"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "content_policy_violation"
            r = await c.post(CHAT, headers=alice, json={"model": "scripted", "messages": [
                {"role": "user", "content": "Im gonna kill you"}]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "content_policy_violation"
            assert backend.requests == []
            r = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "say it"})
            shown = tokens_of(parse_sse(r.text))
            assert "kill" not in shown and parse_sse(r.text)[-1].data["finish_reason"] == "content_filter"
            r = await c.post(CHAT, headers=alice, json={"model": "scripted", "messages": [
                {"role": "user", "content": "say it"}]})
            choice = r.json()["choices"][0]
            assert "kill" not in choice["message"]["content"] and choice["finish_reason"] == "content_filter"


# -- the remote moderator --------------------------------------------------------------------------

class FakeModerations:
    """POST /v1/moderations: flags inputs containing 'forbidden' (category 'harassment'), as OpenAI answers."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.headers: list[str | None] = []
        self.broken = False
        self.app = Starlette(routes=[Route("/v1/moderations", self.moderate, methods=["POST"])])

    async def moderate(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.seen.append(body)
        self.headers.append(request.headers.get("authorization"))
        if self.broken:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=500)
        flagged = "forbidden" in body["input"].lower()
        return JSONResponse({"id": "modr-1", "model": body.get("model", "omni-moderation-latest"), "results": [{
            "flagged": flagged, "categories": {"sexual": False, "harassment": flagged},
            "category_scores": {"sexual": 0.0, "harassment": 0.9 if flagged else 0.01}}]})


@pytest.fixture(scope="module")
def fake_moderations():
    fake = FakeModerations()
    with LiveServer(fake.app) as server:
        yield fake, server.url


@asynccontextmanager
async def remote_app(tmp_path, url: str, pieces: list[str]):
    backend = ScriptedBackend(pieces)
    settings = make_settings(tmp_path, moderation={"mode": "openai", "url": f"{url}/v1", "model": "omni-moderation-latest", "api_key": "sk-test", "timeout_s": 2.0})
    app = create_app(settings, backend)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            yield c, backend, await signup(c, "alice")


async def test_remote_moderator_refuses_flagged_input_on_both_apis(tmp_path, fake_moderations):
    fake, url = fake_moderations
    async with remote_app(tmp_path, url, ["Fine", "."]) as (c, backend, alice):
        cid = await new_conversation(c, alice)
        r = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "something forbidden"})
        assert r.status_code == 400 and "harassment" in r.json()["error"]["message"]
        r = await c.post(CHAT, headers=alice, json={"model": "scripted", "messages": [
            {"role": "user", "content": "FORBIDDEN words"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "content_policy_violation"
        assert backend.requests == []
        r = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hello"})
        assert tokens_of(parse_sse(r.text)) == "Fine."
    assert fake.seen[0] == {"input": "something forbidden", "model": "omni-moderation-latest"}
    assert set(fake.headers) == {"Bearer sk-test"}


async def test_remote_moderator_cuts_flagged_output(tmp_path, fake_moderations):
    fake, url = fake_moderations
    pieces = ["All", " fine", " until", " the", " forbidden", " part", "."]
    async with remote_app(tmp_path, url, pieces) as (c, backend, alice):
        cid = await new_conversation(c, alice)
        r = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "go on"})
        events = parse_sse(r.text)
        assert "forbidden" not in tokens_of(events) and events[-1].data["finish_reason"] == "content_filter"
        r = await c.post(CHAT, headers=alice, json={"model": "scripted", "stream": True, "messages": [
            {"role": "user", "content": "go on"}]})
        chunks = [e.data for e in parse_sse(r.text) if isinstance(e.data, dict)]
        text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
        assert "forbidden" not in text and chunks[-1]["choices"][0]["finish_reason"] == "content_filter"


async def test_remote_moderator_down_fails_closed(tmp_path, fake_moderations):
    fake, url = fake_moderations
    fake.broken = True
    try:
        async with remote_app(tmp_path, url, ["Hi", "."]) as (c, backend, alice):
            cid = await new_conversation(c, alice)
            r = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hello"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "moderation_unavailable"
            assert r.headers["retry-after"] == "5" and backend.requests == []
    finally:
        fake.broken = False


def test_remote_moderation_needs_a_url(tmp_path):
    with pytest.raises(ValueError, match="moderation_url"):
        create_app(make_settings(tmp_path, moderation={"mode": "openai"}), ScriptedBackend())
