"""Responses API input_image parts: a data URL or an uploaded file's id gives the same answer as the chat
API with the same image, a thread behind previous_response_id keeps its images, and a bad part is a 4xx
naming the problem."""
from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

from app_testing import app_client
from test_vision_api import TEXT, ask, data_url, image_part, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import tiny_vision as tv  # noqa: E402

IMAGE = tv.test_image(71, 47, seed=4)


def respond(*parts: dict, **extra) -> dict:
    return {"model": "tiny-vlm", "max_output_tokens": 6, "temperature": 0,
            "input": [{"role": "user", "content": list(parts)}], **extra}


def input_image(**source) -> dict:
    return {"type": "input_image", **source}


QUESTION = {"type": "input_text", "text": TEXT["text"]}


async def test_an_image_by_url_or_file_id_answers_as_the_chat_api_does(tmp_path, vision_backend):
    url = data_url(IMAGE)
    async with app_client(settings(tmp_path), vision_backend) as (client, _, headers):
        chat = await client.post("/v1/chat/completions", headers=headers, json=ask(image_part(url), TEXT))
        assert chat.status_code == 200, chat.text
        want = chat.json()["choices"][0]["message"]["content"]
        by_url = await client.post("/v1/responses", headers=headers, json=respond(input_image(image_url=url), QUESTION))
        assert by_url.status_code == 200, by_url.text
        assert by_url.json()["output"][0]["content"][0]["text"] == want
        assert by_url.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]

        png = base64.b64decode(url.split(",", 1)[1])
        up = await client.post("/v1/files", headers=headers, files={"file": ("cat.png", png, "image/png")},
                               data={"purpose": "vision"})
        assert up.status_code == 200, up.text
        by_file = await client.post("/v1/responses", headers=headers,
                                    json=respond(input_image(file_id=up.json()["id"]), QUESTION))
        assert by_file.status_code == 200, by_file.text
        assert by_file.json()["output"][0]["content"][0]["text"] == want

        # The stored input shows the part as it was given.
        items = await client.get(f"/v1/responses/{by_file.json()['id']}/input_items", headers=headers)
        assert items.json()["data"][0]["content"][0] == {"type": "input_image", "image_url": None,
                                                         "file_id": up.json()["id"], "detail": "auto"}


async def test_a_follow_up_keeps_the_threads_image(tmp_path, vision_backend):
    async with app_client(settings(tmp_path), vision_backend) as (client, _, headers):
        first = await client.post("/v1/responses", headers=headers,
                                  json=respond(input_image(image_url=data_url(IMAGE)), QUESTION))
        assert first.status_code == 200, first.text
        follow = {"model": "tiny-vlm", "max_output_tokens": 4, "temperature": 0, "input": "And its colour?",
                  "previous_response_id": first.json()["id"]}
        r = await client.post("/v1/responses", headers=headers, json=follow)
        assert r.status_code == 200, r.text
        # 3 x 4 tiles and a global view of 4 image tokens each are in the follow-up's prompt too.
        assert r.json()["usage"]["input_tokens"] > first.json()["usage"]["input_tokens"] > 13 * 4


@pytest.mark.parametrize("part,status,code,words", [
    (input_image(), 400, "invalid_value", "image_url"),
    (input_image(image_url="data:image/png;base64,x", file_id="file-1"), 400, "invalid_value", "either"),
    (input_image(file_id="file-nope"), 404, "file_not_found", "file-nope"),
    (input_image(image_url="data:image/png;base64," + base64.b64encode(b"not a picture").decode()), 400,
     "invalid_image", "not an image"),
    (input_image(image_url="http://169.254.169.254/latest/meta-data"), 400, "unsupported_image_url", "fetch_urls"),
    ({"type": "input_audio", "data": "x"}, 400, "unsupported_content", "input_audio"),
])
async def test_bad_image_parts_are_refused_by_name(tmp_path, vision_backend, part, status, code, words):
    async with app_client(settings(tmp_path), vision_backend) as (client, _, headers):
        r = await client.post("/v1/responses", headers=headers, json=respond(part, QUESTION))
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["code"] == code and words in error["message"], error


async def test_a_text_model_refuses_an_input_image(tmp_path, tiny_backend):
    async with app_client(settings(tmp_path), tiny_backend) as (client, _, headers):
        body = respond(input_image(image_url=data_url(IMAGE)), QUESTION, model="tiny-random")
        r = await client.post("/v1/responses", headers=headers, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "unsupported_content"
