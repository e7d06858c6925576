"""A small web on loopback for the fetch and search tests: an article page, a plain-text page, a
PNG, redirects to anywhere (`/redirect?to=URL`), a large page, a slow page, and a fake SearXNG
(`/search?q=...&format=json`) whose results point at the article. Each request's Host header is
recorded.

(A uniquely named module: test modules import it directly.)"""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

ARTICLE = """<html><head><title>Otters of the Danube | Wildlife Weekly</title></head><body>
<nav><a href="/">Home</a> <a href="/about">About</a> <a href="/shop">Shop</a></nav>
<div class="ad">Buy our otter mugs today!</div>
<article><h1>Otters of the Danube</h1>
<p>Eurasian otters have returned to the Danube after decades away. Surveys in 2025 counted 412 animals
between Vienna and Bratislava, the highest number since records began in 1951.</p>
<p>Researchers credit cleaner water and the protection of the riverbanks, which gave the otters both
fish to eat and quiet places to raise their young. The return is seen as a sign of a healthy river.</p>
<p>Local groups now monitor the animals with camera traps and publish the counts every spring, so that
the next survey can compare like with like across the whole stretch of the river.</p>
</article><footer>Copyright Wildlife Weekly</footer></body></html>"""


class FakeWeb:
    def __init__(self) -> None:
        self.hosts: list[str] = []
        self.searches: list[str] = []
        web = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server name
                web.hosts.append(self.headers.get("Host", ""))
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                if url.path == "/article":
                    self._send(200, "text/html; charset=utf-8", ARTICLE.encode())
                elif url.path == "/notes.txt":
                    self._send(200, "text/plain", b"plain notes: 7 otters seen")
                elif url.path == "/image.png":
                    self._send(200, "image/png", b"\x89PNG\r\n\x1a\n" + bytes(100))
                elif url.path == "/large":
                    self._send(200, "text/html", b"<p>" + b"x" * 3_000_000 + b"</p>")
                elif url.path == "/slow":
                    time.sleep(3)
                    self._send(200, "text/plain", b"late")
                elif url.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", query["to"][0])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif url.path == "/search" and query.get("format") == ["json"]:
                    web.searches.append(query["q"][0])
                    base = f"http://{self.headers['Host']}"
                    body = {"query": query["q"][0], "results": [
                        {"title": "Otters of the Danube", "url": f"{base}/article",
                         "content": "Surveys in 2025 counted 412 otters between Vienna and Bratislava."},
                        {"title": "Otter notes", "url": f"{base}/notes.txt", "content": "Field notes."}]}
                    self._send(200, "application/json", json.dumps(body).encode())
                elif url.path == "/garbage/search":
                    self._send(200, "application/json", b"{not json")
                else:
                    self._send(404, "text/plain", b"not found")

            def _send(self, status: int, kind: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"


@contextmanager
def fake_web():
    web = FakeWeb()
    thread = threading.Thread(target=web.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield web
    finally:
        web.server.shutdown()
        web.server.server_close()
        thread.join()
