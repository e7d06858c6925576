"""The remote backend against a real chatloom replica process, and against servers that misbehave."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer

import httpx
import pytest

from chatloom.engine.sampling_params import SamplingParams
from chatloom.serving import Constraint
from chatloom.serving.backend import BackendNotReady, BadGenerationRequest, GenerationRequest
from chatloom.serving.remote import RemoteBackend, ReplicaError, ReplicaModelMismatch, ReplicaTimeout, Timeouts
from fleet_testing import start_replicas

CHAT = [{"role": "user", "content": "Tell me about the sea"}]


async def collect(backend, request) -> tuple[str, object]:
    parts, last = [], None
    async for d in backend.stream(request):
        parts.append(d.text)
        last = d
    return "".join(parts), last


async def test_chat_through_the_chat_endpoint_and_through_token_ids_agree(fleet, tiny_tokenizer):
    url = fleet[0].url
    plain = RemoteBackend(url, "tiny-random")
    with_tok = RemoteBackend(url, "tiny-random", tokenizer=tiny_tokenizer)
    try:
        await plain.start()
        await with_tok.start()
        assert plain.context_window == 2048
        req = GenerationRequest(messages=CHAT, max_tokens=12, temperature=0)
        text_a, last_a = await collect(plain, req)  # /v1/chat/completions
        text_b, last_b = await collect(with_tok, req)  # token ids to /v1/completions
        assert text_a == text_b and last_a.finish_reason == last_b.finish_reason == "length"
        assert last_a.completion_tokens == last_b.completion_tokens == 12
        assert last_a.prompt_tokens == last_b.prompt_tokens == with_tok.count_prompt_tokens(CHAT)
    finally:
        await plain.close()
        await with_tok.close()


async def test_token_stream_carries_every_token_id(fleet, tiny_tokenizer):
    client = RemoteBackend(fleet[0].url, "tiny-random")
    try:
        ids = tiny_tokenizer.encode("hello there")
        pieces = [p async for p in client.stream_tokens(ids, SamplingParams(max_tokens=9, temperature=0))]
        assert pieces[-1].finish_reason == "length" and pieces[-1].usage["completion_tokens"] == 9
        assert len([t for p in pieces for t in p.token_ids]) == 9
        # The replica's /tokenize agrees with the local tokenizer.
        assert await client.tokenize(prompt="hello there") == ids
    finally:
        await client.close()


async def test_vllm_extra_parameters_and_refusals(fleet):
    with httpx.Client(base_url=fleet[0].url, timeout=30) as http:
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 6, "min_tokens": 6,
                                               "ignore_eos": True, "top_k": 3, "temperature": 0.8, "seed": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        bad = http.post("/v1/completions", json={"prompt": "x", "top_k": -4})
        assert bad.status_code == 400 and "top_k" in bad.json()["error"]["message"]
        wrong = http.post("/v1/completions", json={"prompt": "x", "model": "other"})
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
        assert http.post("/v1/completions", content=b"{nope").status_code == 400
        assert http.post("/v1/completions", json={"prompt": [99999]}).status_code == 400
        metrics = http.get("/metrics").text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert name in metrics
    client = RemoteBackend(fleet[0].url, "tiny-random")
    try:
        with pytest.raises(BadGenerationRequest, match="top_k"):
            await collect(client, GenerationRequest(prompt="hi", top_k=-3))
        # A replica cannot honour a grammar: refused with a clear 400, never sent unconstrained.
        with pytest.raises(BadGenerationRequest, match="structured output") as refused:
            await collect(client, GenerationRequest(prompt="hi", constraint=Constraint.json_object()))
        assert refused.value.code == "unsupported_constraint"
    finally:
        await client.close()


async def test_closing_the_stream_aborts_the_request_on_the_replica(fleet):
    client = RemoteBackend(fleet[1].url, "tiny-random")
    try:
        stream = client.stream_tokens([5, 6, 7, 8], SamplingParams(max_tokens=1500, temperature=0))
        async for piece in stream:
            if piece.token_ids:
                break
        await stream.aclose()
        deadline = time.time() + 5
        while time.time() < deadline:
            if (await client.load()).num_requests_running == 0:
                break
            await asyncio.sleep(0.05)
        assert (await client.load()).num_requests_running == 0
    finally:
        await client.close()


async def test_event_feed_reports_the_prompt_blocks_and_catches_up(fleet, tiny_tokenizer):
    from chatloom.engine.block_hash import prefix_block_keys

    client = RemoteBackend(fleet[2].url, "tiny-random")
    try:
        start = (await client.kv_events(0, 0))["last_seq"]
        ids = list(range(10, 60))
        [p async for p in client.stream_tokens(ids, SamplingParams(max_tokens=2, temperature=0))]
        feed = await client.kv_events(start, 1.0)
        stored = {k for e in feed["events"] if e["type"] == "stored" for k in e["keys"]}
        assert set(prefix_block_keys(ids, feed["block_size"], feed["model_key"])) <= stored
        snap = await client.kv_events(10**9, 0)  # a router ahead of the replica (it restarted): snapshot
        assert snap["reset"] and stored <= set(snap["snapshot"])
    finally:
        await client.close()


# -- servers that misbehave -----------------------------------------------------------------------

class _Garbage(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html>hello</html>")

    def log_message(self, *a):
        pass


@pytest.fixture
def garbage_server():
    srv = HTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture
def silent_server():
    """Accepts connections and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


async def test_bad_servers_give_clear_errors_fast(fleet, garbage_server, silent_server):
    cases = [(garbage_server, "tiny-random", "did not answer JSON"),
             (silent_server, "tiny-random", "no answer in time"),
             ("http://127.0.0.1:9", "tiny-random", "connection refused"),
             (fleet[0].url, "some-other-model", "serves tiny-random, not 'some-other-model'")]
    for url, model, message in cases:
        client = RemoteBackend(url, model, timeouts=Timeouts(connect=1.0, probe=1.5))
        t0 = time.monotonic()
        with pytest.raises(BackendNotReady, match=message):
            await client.start()
        assert time.monotonic() - t0 < 5
        await client.close()
    with pytest.raises(ReplicaModelMismatch):
        await RemoteBackend(fleet[0].url, "some-other-model").probe()
    with pytest.raises(ValueError, match="http://"):
        RemoteBackend("localhost:8000")
    assert issubclass(ReplicaModelMismatch, ReplicaError)


def _send_json(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@contextlib.contextmanager
def _serving(handler: type[BaseHTTPRequestHandler], mode: str | None = None):
    """`handler` served on a loopback port in threads of its own (`mode` on the server for it to read): the URL."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.mode = mode
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


class _SlowTokenizer(BaseHTTPRequestHandler):
    """A saturated replica: /tokenize answers, but later than a health probe may take."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(0.8)
        _send_json(self, 200, b'{"tokens": [1, 2, 3], "count": 3}')

    def log_message(self, *a):
        pass


async def test_a_slow_tokenize_on_a_busy_replica_is_waited_for():
    with _serving(_SlowTokenizer) as url:
        client = RemoteBackend(url, "tiny-random", timeouts=Timeouts(connect=1.0, probe=0.2))
        try:
            assert await client.tokenize(prompt="hello") == [1, 2, 3]
        finally:
            await client.close()


class _BrokenStreams(BaseHTTPRequestHandler):
    """A replica whose answer goes wrong in the way `self.server.mode` names."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        mode = self.server.mode
        if mode == "refused":
            _send_json(self, 400, b'{"error": {"message": "max_tokens is too large", "code": "invalid_request"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        chunk = b'data: {"choices": [{"text": "a", "token_ids": [7], "finish_reason": null}]}\n\n'
        self.wfile.write(chunk)
        self.wfile.flush()
        if mode == "silent":
            time.sleep(1.5)
        # "cut": the connection closes here, mid-answer

    def log_message(self, *a):
        pass


@pytest.mark.parametrize("mode, error, message", [
    ("refused", BadGenerationRequest, "max_tokens is too large"),
    ("cut", ReplicaError, "ended without \\[DONE\\]|connection broke"),
    ("silent", ReplicaTimeout, "no answer in time"),
])
async def test_a_stream_that_goes_wrong_fails_with_a_clear_error(mode, error, message):
    with _serving(_BrokenStreams, mode) as url:
        client = RemoteBackend(url, "tiny-random", timeouts=Timeouts(between_chunks=0.5))
        pieces = []
        try:
            with pytest.raises(error, match=message):
                async for piece in client.stream_tokens([1, 2, 3], SamplingParams(max_tokens=4)):
                    pieces.append(piece.token_ids)
            assert pieces == ([] if mode == "refused" else [[7]])  # what came before the fault was passed on
        finally:
            await client.close()


async def test_a_stream_to_a_closed_port_says_so():
    client = RemoteBackend("http://127.0.0.1:9", "tiny-random", timeouts=Timeouts(stream_connect=1.0))
    try:
        with pytest.raises(ReplicaError, match="connection refused"):
            async for _ in client.stream_tokens([1, 2, 3], SamplingParams(max_tokens=4)):
                pass
    finally:
        await client.close()


@pytest.fixture(scope="module")
def one_slot_replica():
    """A replica that runs one request at a time: the order it takes the queued ones in is visible."""
    (rep,) = start_replicas(1, extra=["--max-num-seqs", "1"])
    yield rep
    rep.stop()


@pytest.mark.parametrize("through", ["remote", "router"])
async def test_a_batch_priority_reaches_the_replica_and_an_interactive_request_goes_first(one_slot_replica,
                                                                                         tiny_tokenizer, through):
    from chatloom.serving.router import Router

    client = RemoteBackend(one_slot_replica.url, "tiny-random", tokenizer=tiny_tokenizer)
    backend = client if through == "remote" else Router("tiny-random", [one_slot_replica.url],
                                                        tokenizer=tiny_tokenizer)
    batch = GenerationRequest(prompt="a batch line", max_tokens=4, temperature=0, priority=1000)
    firsts: list[str] = []

    async def first_token(name: str, request: GenerationRequest) -> None:
        async for _ in backend.stream(request):
            firsts.append(name)
            return

    try:
        await client.start()
        if backend is not client:
            await backend.start()
        assert client._info is not None and client._info.takes_priority
        running = client.stream_tokens(tiny_tokenizer.encode("hold the only slot"),
                                       SamplingParams(max_tokens=200, min_tokens=200, temperature=0), priority=1000)
        await running.__anext__()  # the slot is taken until this one ends
        waiting = asyncio.create_task(first_token("batch", batch))
        while (await client.load()).num_requests_waiting < 1:  # the batch request is queued first
            await asyncio.sleep(0.02)
        interactive = asyncio.create_task(first_token("interactive", GenerationRequest(
            prompt="a question", max_tokens=4, temperature=0)))
        while (await client.load()).num_requests_waiting < 2:
            await asyncio.sleep(0.02)
        async for _ in running:  # the slot frees: the interactive request, though later, runs first
            pass
        await asyncio.gather(waiting, interactive)
        assert firsts == ["interactive", "batch"]
    finally:
        await client.close()
        if backend is not client:
            await backend.close()


async def test_a_priority_that_is_not_an_integer_is_a_400(fleet):
    with httpx.Client(base_url=fleet[0].url, timeout=30) as http:
        r = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "priority": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
