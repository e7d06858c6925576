"""A fake OpenAI-compatible embedding server on loopback: POST /v1/embeddings answers each input with a
hashed bag of its words (64 dimensions), so texts sharing words lie close. `mode` makes it fail: "error"
(500), "garbage" (a body of the wrong shape) or "short" (one vector fewer than inputs). Each request's
body and Authorization header are recorded.

(A uniquely named module: test modules import it directly.)"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

WIDTH = 64


def bag_of_words(text: str) -> list[float]:
    v = [0.0] * WIDTH
    for word in re.findall(r"[a-z]+", text.lower()):
        v[int(hashlib.sha256(word.encode()).hexdigest(), 16) % WIDTH] += 1.0
    v[0] += 0.01  # never the zero vector
    return v


class FakeEmbeddings:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.auth: list[str | None] = []
        self.mode = "ok"
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                server.requests.append(body)
                server.auth.append(self.headers.get("Authorization"))
                if self.path != "/v1/embeddings" or server.mode == "error":
                    self._send(500, {"error": {"message": "down"}})
                elif server.mode == "garbage":
                    self._send(200, {"data": "not a list"})
                else:
                    texts = body["input"][:-1] if server.mode == "short" else body["input"]
                    data = [{"object": "embedding", "index": i, "embedding": bag_of_words(t)}
                            for i, t in enumerate(texts)]
                    self._send(200, {"object": "list", "model": body["model"], "data": data[::-1],
                                     "usage": {"prompt_tokens": 7, "total_tokens": 7}})

            def _send(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/embeddings"

    def inputs(self) -> list[str]:
        return [t for r in self.requests for t in r["input"]]


@contextmanager
def fake_embeddings() -> Iterator[FakeEmbeddings]:
    fake = FakeEmbeddings()
    thread = threading.Thread(target=fake.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        fake.httpd.shutdown()
        fake.httpd.server_close()
        thread.join()
