"""The answer path's HTTP client against a real local server: whole answers, streams, and each way they fail."""
from __future__ import annotations

import asyncio
import socket
import ssl

import pytest
from aiohttp import web

from chatloom.serving.answer_http import READ_BUFFER_BYTES, AnswerClient, AnswerHTTPError


async def _stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(body.get("events", 3)):
        await response.write(f"data: {{\"i\": {i}}}\r\n\r\n".encode())
    if body.get("hang"):
        await asyncio.sleep(30)
    if body.get("long"):
        await response.write(b"data: " + b"x" * (2 * READ_BUFFER_BYTES + 10) + b"\n")
    await response.write(b"data: [DONE]\n\n")
    return response


async def _tokenize(request: web.Request) -> web.Response:
    body = await request.json()
    if body.get("garbage"):
        return web.Response(text="<html>not json</html>", status=502)
    return web.json_response({"tokens": [1, 2, 3], "auth": request.headers.get("Authorization")})


@pytest.fixture
async def server():
    app = web.Application()
    app.router.add_post("/v1/completions", _stream)
    app.router.add_post("/tokenize", _tokenize)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _client(url: str, between_chunks_s: float = 10.0) -> AnswerClient:
    return AnswerClient(url, {"Authorization": "Bearer k"}, ssl.create_default_context(), 3.0, between_chunks_s)


async def test_a_whole_answer_and_a_streamed_one(server):
    client = _client(server)
    answered = await client.post("/tokenize", {"prompt": "hi"})
    assert answered.status == 200 and answered.body == {"tokens": [1, 2, 3], "auth": "Bearer k"}
    garbage = await client.post("/tokenize", {"garbage": True})
    assert garbage.status == 502 and garbage.body is None
    async with client.stream("/v1/completions", {"events": 2}) as r:
        assert r.status == 200
        lines = [line async for line in r.lines()]
    # Line ends (\r\n too) are gone; the empty lines between events stay.
    assert lines == [b'data: {"i": 0}', b"", b'data: {"i": 1}', b"", b"data: [DONE]", b""]
    await client.aclose()


async def test_a_closed_port_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = _client(f"http://127.0.0.1:{port}")
    with pytest.raises(AnswerHTTPError, match="connection refused") as caught:
        async with client.stream("/v1/completions", {}):
            pass
    assert not caught.value.timed_out
    with pytest.raises(AnswerHTTPError, match="connection refused"):
        await client.post("/tokenize", {})
    await client.aclose()


async def test_a_silent_server_times_out_between_chunks(server):
    client = _client(server, between_chunks_s=0.3)
    with pytest.raises(AnswerHTTPError, match="no answer in time") as caught:
        async with client.stream("/v1/completions", {"events": 1, "hang": True}) as r:
            async for _ in r.lines():
                pass
    assert caught.value.timed_out
    await client.aclose()


async def test_closing_under_the_reader_ends_its_read_with_an_error(server):
    client = _client(server)
    async with client.stream("/v1/completions", {"events": 1, "hang": True}) as r:
        seen = []

        async def read() -> None:
            async for line in r.lines():
                seen.append(line)
                if line.startswith(b"data:"):
                    asyncio.get_running_loop().call_soon(r.close)

        with pytest.raises(AnswerHTTPError) as caught:
            await asyncio.wait_for(read(), 5)
    assert seen[0] == b'data: {"i": 0}' and not caught.value.timed_out
    await client.aclose()


async def test_a_line_past_the_limit_is_an_error_not_a_crash(server):
    client = _client(server)
    with pytest.raises(AnswerHTTPError, match="too long"):
        async with client.stream("/v1/completions", {"events": 0, "long": True}) as r:
            async for _ in r.lines():
                pass
    await client.aclose()


def test_one_client_serves_one_event_loop_after_another():
    """A backend may outlive a loop: the next loop gets a session of its own."""
    async def once() -> int:
        app = web.Application()
        app.router.add_post("/tokenize", _tokenize)
        runner = web.AppRunner(app, shutdown_timeout=0.2)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            return (await client.post("/tokenize", {})).status
        finally:
            await runner.cleanup()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = _client(f"http://127.0.0.1:{port}")
    assert asyncio.run(once()) == 200
    assert asyncio.run(once()) == 200
    asyncio.run(client.aclose())
