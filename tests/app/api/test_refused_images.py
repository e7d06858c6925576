"""A request refused for a bad image costs nothing: every front leaves the user's quota counters and usage
as they were, and a Responses API request stores no response, conversation, message or file."""
from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

from app_testing import app_client, make_settings, new_conversation
from test_vision_api import TEXT, ask, data_url, image_part

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import tiny_vision as tv  # noqa: E402

NOT_AN_IMAGE = base64.b64encode(b"plain text, not a picture").decode()


def _corrupt() -> str:
    raw = base64.b64decode(data_url(tv.test_image(40, 40)).split(",", 1)[1])
    return base64.b64encode(raw[: len(raw) // 2]).decode()


def _settings(tmp_path):
    from traffic_testing import write_tiers

    tiers = write_tiers(tmp_path, free={"max_concurrent": 4, "requests_per_minute": 100,
                                        "tokens_per_minute": 50_000, "tokens_per_day": 1_000_000})
    return make_settings(tmp_path, server={"db_url": f"sqlite+aiosqlite:///{tmp_path}/chatloom.db",
                                           "max_body_bytes": 4_000_000}, traffic={"tiers_file": tiers})


async def _counters(client, app, headers) -> tuple:
    """The quota counters (requests, tokens this minute, tokens today) and the /usage report."""
    from chatloom.store import Users

    ctx = app.state.ctx
    async with ctx.db.session() as session:
        user = await Users(session).by_username("alice")
    state = await ctx.traffic.quotas.state(user.id, ctx.traffic.tier(user))
    usage = (await client.get("/usage", headers=headers)).json()
    return state.remaining_requests, state.remaining_tokens, state.day_used, usage


async def _rows(app) -> dict[str, int]:
    from sqlalchemy import func, select

    from chatloom.store import StoredResponse
    from chatloom.store.message_images import MessageImage
    from chatloom.store.models import Conversation, DailyUsage, Message, StoredFile

    out = {}
    async with app.state.ctx.db.session() as session:
        for table in (StoredResponse, Conversation, Message, MessageImage, StoredFile, DailyUsage):
            out[table.__tablename__] = await session.scalar(select(func.count()).select_from(table))
    return out


def _bad_requests(payload: str, cid: str) -> list[tuple[str, dict]]:
    """One request per front, each with the same bad image."""
    url = f"data:image/png;base64,{payload}"
    anthropic = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": payload}}
    return [("/v1/chat/completions", ask(image_part(url), TEXT)),
            ("/v1/chat/completions", ask(image_part(url), TEXT, stream=True)),
            (f"/conversations/{cid}/messages", {"text": "look", "images": [url]}),
            ("/v1/responses", {"model": "tiny-vlm", "max_output_tokens": 4, "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}),
            ("/v1/messages", {"model": "tiny-vlm", "max_tokens": 4, "messages": [
                {"role": "user", "content": [anthropic, {"type": "text", "text": "What is it?"}]}]})]


@pytest.mark.parametrize("payload", [NOT_AN_IMAGE, "corrupt"], ids=["not an image", "corrupt"])
async def test_a_refused_image_leaves_the_quota_and_usage_as_they_were(tmp_path, vision_backend, payload):
    payload = _corrupt() if payload == "corrupt" else payload
    async with app_client(_settings(tmp_path), vision_backend) as (client, app, headers):
        ok = await client.post("/v1/chat/completions", headers=headers,
                               json=ask(image_part(data_url(tv.test_image(16, 16))), TEXT))
        assert ok.status_code == 200, ok.text  # some usage to compare with, not an empty report
        cid = await new_conversation(client, headers)
        before = await _counters(client, app, headers)
        assert before[3]["data"], before
        for path, body in _bad_requests(payload, cid):
            r = await client.post(path, headers=headers, json=body)
            assert r.status_code == 400, (path, r.text)
            assert "image" in r.json()["error"]["message"], (path, r.text)
        assert await _counters(client, app, headers) == before


@pytest.mark.parametrize("stream", [False, True])
async def test_a_responses_request_with_a_bad_image_stores_nothing(tmp_path, vision_backend, stream):
    async with app_client(_settings(tmp_path), vision_backend) as (client, app, headers):
        text = await client.post("/v1/files", headers=headers, data={"purpose": "user_data"},
                                 files={"file": ("notes.txt", b"not a picture either", "text/plain")})
        assert text.status_code == 200, text.text
        before = await _rows(app)
        parts = [{"type": "input_image", "image_url": f"data:image/png;base64,{NOT_AN_IMAGE}"},
                 {"type": "input_image", "image_url": f"data:image/png;base64,{_corrupt()}"},
                 {"type": "input_image", "file_id": text.json()["id"]}]
        for part in parts:
            body = {"model": "tiny-vlm", "max_output_tokens": 4, "stream": stream, "store": True,
                    "input": [{"role": "user", "content": [part, {"type": "input_text", "text": "What is it?"}]}]}
            r = await client.post("/v1/responses", headers=headers, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", r.text
            assert "id" not in r.json()  # no response object was made, so none can be fetched
        assert await _rows(app) == before
        listed = await client.get("/conversations", headers=headers)
        assert listed.status_code == 200 and listed.json() == [], listed.text
