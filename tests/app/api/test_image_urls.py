"""http(s) image URLs: refused by name unless vision.fetch_urls is on; then fetched with safe_fetch's
protection (a loopback address only when allow-listed), sniffed and checked like inline images."""
from __future__ import annotations

import io
import sys
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from app_testing import app_client
from test_vision_api import TEXT, ask, data_url, image_part, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import tiny_vision as tv  # noqa: E402


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


IMAGE = tv.test_image(71, 47, seed=1)
PAGES = {"/cat.png": (200, "image/png", _png(IMAGE)),
         "/cat-as-text": (200, "text/plain", _png(IMAGE)),  # sniffed: a PNG whatever the header says
         "/notes.png": (200, "image/png", b"these are notes, not a picture"),
         "/big.png": (200, "image/png", bytes(3_000_000)),
         "/gone.png": (404, "text/plain", b"not found")}


@contextmanager
def image_server():
    requests: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            requests.append(self.path)
            status, kind, body = PAGES.get(self.path, (404, "text/plain", b""))
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def _post(tmp_path, backend, url: str, **vision):
    async with app_client(settings(tmp_path, max_image_bytes=2_000_000, **vision), backend) as (client, _, headers):
        return await client.post("/v1/chat/completions", headers=headers, json=ask(image_part(url), TEXT))


async def test_urls_are_refused_by_name_while_fetching_is_off(tmp_path, vision_backend):
    with image_server() as (base, requests):
        r = await _post(tmp_path, vision_backend, f"{base}/cat.png")
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "unsupported_image_url"
    assert "vision.fetch_urls" in r.json()["error"]["message"]
    assert requests == []


async def test_a_private_address_is_refused_unless_allow_listed(tmp_path, vision_backend):
    with image_server() as (base, requests):
        r = await _post(tmp_path, vision_backend, f"{base}/cat.png", fetch_urls=True)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "image_url_refused" and "loopback" in error["message"], error
        assert requests == []  # refused before any connection
        fetched = await _post(tmp_path / "allowed", vision_backend, f"{base}/cat.png", fetch_urls=True,
                              fetch_allow=["127.0.0.1"])
    inline = await _post(tmp_path / "inline", vision_backend, data_url(IMAGE))
    assert fetched.status_code == inline.status_code == 200, fetched.text
    assert fetched.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]
    assert fetched.json()["usage"]["prompt_tokens"] == inline.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path,code,words", [
    ("/notes.png", "invalid_image", "not an image"),
    ("/big.png", "image_url_refused", "larger than 2000000 bytes"),
    ("/gone.png", "image_url_refused", "HTTP 404"),
])
async def test_what_a_url_serves_is_checked_like_an_inline_image(tmp_path, vision_backend, path, code, words):
    with image_server() as (base, _):
        r = await _post(tmp_path, vision_backend, base + path, fetch_urls=True, fetch_allow=["127.0.0.0/8"])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and words in error["message"], error


async def test_the_content_type_does_not_decide_what_an_image_is(tmp_path, vision_backend):
    with image_server() as (base, _):
        r = await _post(tmp_path, vision_backend, f"{base}/cat-as-text", fetch_urls=True, fetch_allow=["127.0.0.1"])
    assert r.status_code == 200, r.text


async def test_a_conversation_message_takes_a_fetched_image(tmp_path, vision_backend):
    from app_testing import new_conversation

    with image_server() as (base, _):
        async with app_client(settings(tmp_path, fetch_urls=True), vision_backend) as (client, _, headers):
            conv = await new_conversation(client, headers)
            r = await client.post(f"/conversations/{conv}/messages", headers=headers,
                                  json={"text": "What is it?", "images": [f"{base}/cat.png"]})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "image_url_refused"
            messages = await client.get(f"/conversations/{conv}", headers=headers)
            assert messages.json()["messages"] == []  # nothing stored
