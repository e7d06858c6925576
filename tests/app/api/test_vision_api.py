"""Images through the OpenAI-compatible API: image_url data URLs to a vision model, the vision
capability in /v1/models, images counted as the tokens they become, and a 400 naming each bad input."""
from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import pytest
from PIL import Image

from app_testing import app_client, make_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import tiny_vision as tv  # noqa: E402


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def ask(*parts: dict, model: str = "tiny-vlm", **extra) -> dict:
    return {"model": model, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": list(parts)}], **extra}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "What is in this picture?"}


def settings(tmp_path, **vision):
    return make_settings(tmp_path, server={"db_url": f"sqlite+aiosqlite:///{tmp_path}/chatloom.db",
                                           "max_body_bytes": 4_000_000}, vision=vision)


async def test_models_say_which_take_images(tmp_path, vision_backend, tiny_backend):
    async with app_client(settings(tmp_path), vision_backend) as (client, _, headers):
        r = await client.get("/v1/models", headers=headers)
        assert r.json()["data"][0]["capabilities"]["vision"] is True
    async with app_client(settings(tmp_path / "text"), tiny_backend) as (client, _, headers):
        r = await client.get("/v1/models", headers=headers)
        assert r.json()["data"][0]["capabilities"]["vision"] is False


async def test_an_image_is_read_and_counted_as_its_tokens(tmp_path, vision_backend):
    async with app_client(settings(tmp_path), vision_backend) as (client, _, headers):
        plain = await client.post("/v1/chat/completions", headers=headers, json=ask(TEXT))
        assert plain.status_code == 200, plain.text
        one = tv.test_image(71, 47, seed=1)
        r = await client.post("/v1/chat/completions", headers=headers, json=ask(image_part(data_url(one)), TEXT))
        assert r.status_code == 200, r.text
        # 71 x 47 becomes 3 x 4 tiles and a global view of 4 image tokens each, with their tags.
        added = r.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"]
        assert added >= 13 * 4
        again = await client.post("/v1/chat/completions", headers=headers,
                                  json=ask(image_part(data_url(one, "JPEG")), TEXT))
        other = await client.post("/v1/chat/completions", headers=headers,
                                  json=ask(image_part(data_url(tv.test_image(71, 47, seed=2))), TEXT))
        assert again.status_code == other.status_code == 200
        answers = {x.json()["choices"][0]["message"]["content"] for x in (plain, r, other)}
        assert len(answers) > 1  # the image is read, not ignored


def _bomb() -> str:
    # 6000 x 5000 pixels of one colour: a few kilobytes of PNG.
    return data_url(Image.new("L", (6000, 5000), 0))


@pytest.mark.parametrize("url,code,words", [
    ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(), "invalid_image", "not an image"),
    ("data:image/png;base64,AAAA%%%", "invalid_image", "base64"),
    ("data:text/plain;base64,aGVsbG8=", "invalid_image", "not an image"),
    ("https://example.com/cat.png", "unsupported_image_url", "data URL"),
    ("corrupt", "invalid_image", "corrupt"),
    ("bomb", "image_too_large", "pixels"),
])
async def test_bad_images_are_refused_with_a_400_naming_the_problem(tmp_path, vision_backend, url, code, words):
    if url == "corrupt":
        good = data_url(tv.test_image(40, 40))
        raw = base64.b64decode(good.split(",", 1)[1])
        url = "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()
    elif url == "bomb":
        url = _bomb()
    async with app_client(settings(tmp_path, max_image_pixels=1_000_000), vision_backend) as (client, _, headers):
        r = await client.post("/v1/chat/completions", headers=headers, json=ask(image_part(url), TEXT))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == code and words in error["message"], error


async def test_too_many_images_are_refused(tmp_path, vision_backend):
    url = data_url(tv.test_image(16, 16))
    async with app_client(settings(tmp_path, max_images_per_request=2), vision_backend) as (client, _, headers):
        r = await client.post("/v1/chat/completions", headers=headers,
                              json=ask(image_part(url), image_part(url), image_part(url), TEXT))
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images", r.text
        ok = await client.post("/v1/chat/completions", headers=headers, json=ask(image_part(url), image_part(url), TEXT))
        assert ok.status_code == 200, ok.text


async def test_a_model_that_takes_no_images_refuses_them(tmp_path, tiny_backend):
    async with app_client(settings(tmp_path), tiny_backend) as (client, _, headers):
        r = await client.post("/v1/chat/completions", headers=headers,
                              json=ask(image_part(data_url(tv.test_image(16, 16))), TEXT, model="tiny-random"))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "unsupported_content" and "does not take images" in r.json()["error"]["message"]


async def test_typed_marker_characters_never_stand_for_an_image(tmp_path, vision_backend):
    async with app_client(settings(tmp_path), vision_backend) as (client, _, headers):
        r = await client.post("/v1/chat/completions", headers=headers,
                              json=ask({"type": "text", "text": "look \ufffc here"}))
        assert r.status_code == 200, r.text


def anthropic_image(image: Image.Image) -> dict:
    url = data_url(image)
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}}


async def test_anthropic_image_blocks_reach_a_vision_model(tmp_path, vision_backend):
    async with app_client(settings(tmp_path), vision_backend) as (client, _, headers):
        body = {"model": "tiny-vlm", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": [anthropic_image(tv.test_image(71, 47, seed=1)),
                                                          {"type": "text", "text": "What is in this picture?"}]}]}
        r = await client.post("/v1/messages", headers=headers, json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        prompt_tokens = usage["input_tokens"] + usage["cache_read_input_tokens"]  # Anthropic leaves cache reads out
        counted = await client.post("/v1/messages/count_tokens", headers=headers, json=body)
        assert counted.json()["input_tokens"] == prompt_tokens
        # The same image through the OpenAI front is the same prompt.
        same = await client.post("/v1/chat/completions", headers=headers,
                                 json=ask(image_part(data_url(tv.test_image(71, 47, seed=1))), TEXT))
        assert same.json()["usage"]["prompt_tokens"] == prompt_tokens
        bad = {**body, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}]}]}
        r = await client.post("/v1/messages", headers=headers, json=bad)
        assert r.status_code == 400 and "not an image" in r.json()["error"]["message"], r.text


async def test_anthropic_image_to_a_text_model_is_refused(tmp_path, tiny_backend):
    async with app_client(settings(tmp_path), tiny_backend) as (client, _, headers):
        r = await client.post("/v1/messages", headers=headers, json={
            "model": "tiny-random", "max_tokens": 4,
            "messages": [{"role": "user", "content": [anthropic_image(tv.test_image(16, 16))]}]})
        assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"], r.text


# -- images kept in a conversation ---------------------------------------------------------------

async def _vision_files(app) -> list:
    from sqlalchemy import select
    from chatloom.store.models import StoredFile
    async with app.state.ctx.db.session() as session:
        return list((await session.execute(select(StoredFile).where(StoredFile.purpose == "vision"))).scalars())


async def test_a_conversation_keeps_its_images(tmp_path, vision_backend):
    from app_testing import RecordingBackend, new_conversation, send
    recording = RecordingBackend(vision_backend)
    async with app_client(settings(tmp_path), recording) as (client, app, headers):
        cid = await new_conversation(client, headers)
        image = tv.test_image(71, 47, seed=4)
        _, events = await send(client, headers, cid, "What is in this picture?", images=[data_url(image)],
                               max_tokens=3)
        first = recording.answers()[-1].messages[-1]
        assert len(first["images"]) == 1 and first["content"].endswith("What is in this picture?")
        files = await _vision_files(app)
        assert len(files) == 1 and files[0].content_type == "image/png"
        assert app.state.ctx.blobs.exists(files[0].blob_key)
        runs = vision_backend.engine.engine.runner.encoder_runs
        # A second question, text only: the image is still in the prompt, read back from the blob store,
        # and its embeddings and KV blocks are reused.
        await send(client, headers, cid, "And the colours?", max_tokens=3)
        second = recording.answers()[-1].messages
        kept = [m for m in second if m.get("images")]
        assert len(kept) == 1 and kept[0]["images"][0].content_hash == first["images"][0].content_hash
        assert vision_backend.engine.engine.runner.encoder_runs == runs
        r = await client.get(f"/conversations/{cid}", headers=headers)
        user_msgs = [m for m in r.json()["messages"] if m["role"] == "user"]
        assert user_msgs[0]["tokens"] > 13 * 4  # the stored count includes the image's tokens
        # Each message names its images; the browser shows them from the files API.
        assert user_msgs[0]["images"] == [files[0].id] and user_msgs[1]["images"] == []
        content = await client.get(f"/v1/files/{files[0].id}/content", headers=headers)
        assert content.status_code == 200
        assert content.content == base64.b64decode(data_url(image).split(",", 1)[1])


async def test_a_bad_image_in_a_conversation_stores_nothing(tmp_path, vision_backend, tiny_backend):
    from app_testing import new_conversation
    async with app_client(settings(tmp_path), vision_backend) as (client, app, headers):
        cid = await new_conversation(client, headers)
        bad = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
        r = await client.post(f"/conversations/{cid}/messages", headers=headers,
                              json={"text": "look", "images": [bad]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", r.text
        assert await _vision_files(app) == []
        detail = await client.get(f"/conversations/{cid}", headers=headers)
        assert detail.json()["messages"] == []
    async with app_client(settings(tmp_path / "text"), tiny_backend) as (client, app, headers):
        cid = await new_conversation(client, headers)
        r = await client.post(f"/conversations/{cid}/messages", headers=headers,
                              json={"text": "look", "images": [data_url(tv.test_image(16, 16))]})
        assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"], r.text
        assert await _vision_files(app) == []
