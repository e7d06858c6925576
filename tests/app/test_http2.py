"""HTTP/2 over TLS (Hypercorn): many SSE streams share one connection and all of them progress at once
(over HTTP/1.1 a browser would stall the seventh tab)."""
from __future__ import annotations

import asyncio
import logging
import shutil
import ssl
import subprocess
import time

import httpx
import pytest

from chatloom.app.http_server import quiet_tls_closes_at_shutdown, serve_h2
from chatloom.app.main import create_app
from chatloom.cli.main import main as cli_main

from app_testing import free_port, make_settings, new_conversation, parse_sse, signup
from traffic_testing import ScriptedBackend, write_tiers

STREAMS = 10
PIECES = [f" p{i}" for i in range(30)]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return str(d / "cert.pem"), str(d / "key.pem")


async def test_ten_sse_streams_progress_together_over_one_http2_connection(tmp_path, certificate):
    port = free_port()
    tiers = write_tiers(tmp_path, free={"max_concurrent": 100, "tokens_per_minute": 100_000})
    settings = make_settings(tmp_path, server={"port": port}, sampling={"max_tokens": 50}, traffic={"tiers_file": tiers})
    backend = ScriptedBackend(PIECES, delay_s=0.1)  # each answer takes about 3 s
    app = create_app(settings, backend)
    stop = asyncio.Event()
    async with app.router.lifespan_context(app):
        server = asyncio.create_task(serve_h2(app, settings, *certificate, stop=stop))
        try:
            async with httpx.AsyncClient(base_url=f"https://127.0.0.1:{port}", http2=True, verify=False,
                                         timeout=30) as client:
                for _ in range(100):  # wait for the server to listen
                    try:
                        await client.get("/healthz")
                        break
                    except httpx.ConnectError:
                        await asyncio.sleep(0.05)
                user = await signup(client, "alice")
                conversations = [await new_conversation(client, user) for _ in range(STREAMS)]
                first_token: dict[int, float] = {}
                ended: dict[int, float] = {}
                versions = set()

                async def one(i: int) -> str:
                    text = ""
                    async with client.stream("POST", f"/conversations/{conversations[i]}/messages",
                                             headers=user, json={"text": f"hello {i}"}) as r:
                        assert r.status_code == 200
                        versions.add(r.http_version)
                        async for chunk in r.aiter_text():
                            text += chunk
                            if i not in first_token and '"token"' in text:
                                first_token[i] = time.monotonic()
                    ended[i] = time.monotonic()
                    return text

                texts = await asyncio.gather(*(one(i) for i in range(STREAMS)))
                pool = client._transport._pool
                assert len(pool.connections) == 1  # every stream on one connection
        finally:
            stop.set()
            await server
    assert versions == {"HTTP/2"}
    for text in texts:
        events = parse_sse(text)
        assert "".join(e.data.get("token", "") for e in events) == "".join(PIECES)
        assert events[-1].data["status"] == "complete"
    # All progressed at once: every stream had its first token before any stream ended.
    assert max(first_token.values()) < min(ended.values())


def test_serve_rejects_half_a_tls_pair(capsys):
    assert cli_main(["serve", "--tls-cert", "/nonexistent/cert.pem"]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    assert cli_main(["serve", "--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"]) == 2
    assert "no such file: /nonexistent/c.pem" in capsys.readouterr().err


async def test_stopping_with_sse_streams_open_ends_the_server_cleanly(tmp_path, certificate):
    """Hypercorn raises its connections' errors out of serve() when it closes HTTP/2 connections with
    streams open; on SIGTERM that was an exit status 1 and a traceback after a good shutdown."""
    port = free_port()
    tiers = write_tiers(tmp_path, free={"max_concurrent": 100, "tokens_per_minute": 100_000})
    settings = make_settings(tmp_path, server={"port": port}, sampling={"max_tokens": 200}, traffic={"tiers_file": tiers})
    app = create_app(settings, ScriptedBackend([f" p{i}" for i in range(100)], delay_s=0.02))
    stop = asyncio.Event()
    async with app.router.lifespan_context(app):
        server = asyncio.create_task(serve_h2(app, settings, *certificate, stop=stop))
        async with httpx.AsyncClient(base_url=f"https://127.0.0.1:{port}", http2=True, verify=False,
                                     timeout=30) as client:
            for _ in range(100):
                try:
                    await client.get("/healthz")
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
            user = await signup(client, "alice")
            conversations = [await new_conversation(client, user) for _ in range(STREAMS)]

            async def one(i: int) -> None:
                try:
                    async with client.stream("POST", f"/conversations/{conversations[i]}/messages", headers=user,
                                             json={"text": "hello"}) as r:
                        async for n, _ in aenumerate(r.aiter_text()):
                            if i % 2 and n > 3:
                                return  # half the clients leave early, as in real use
                except httpx.HTTPError:
                    pass  # the server closing the connection

            readers = [asyncio.create_task(one(i)) for i in range(STREAMS)]
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.wait_for(server, 30)  # before the fix: raised an ExceptionGroup
            await asyncio.gather(*readers)


async def aenumerate(items):
    n = 0
    async for item in items:
        yield n, item
        n += 1


def test_tls_errors_of_connections_closed_at_shutdown_are_not_errors(caplog):
    """A drain closes every open connection; a TLS error from one then is a debug line, while the same
    error before the server stops, or another error at shutdown, still reaches asyncio's handler."""
    stopping = False
    handle = quiet_tls_closes_at_shutdown(lambda: stopping)
    loop = asyncio.new_event_loop()
    tls_error = ssl.SSLError(1, "[SSL: APPLICATION_DATA_AFTER_CLOSE_NOTIFY] application data after close notify")
    try:
        with caplog.at_level(logging.DEBUG):
            handle(loop, {"message": "Unhandled exception in client_connected_cb", "exception": tls_error})
            assert [r.levelno for r in caplog.records] == [logging.ERROR]  # serving: asyncio reports it
            caplog.clear()
            stopping = True
            handle(loop, {"message": "Unhandled exception in client_connected_cb", "exception": tls_error})
            assert [r.levelno for r in caplog.records] == [logging.DEBUG]
            caplog.clear()
            handle(loop, {"message": "Task exception was never retrieved", "exception": RuntimeError("bug")})
            assert [r.levelno for r in caplog.records] == [logging.ERROR]
    finally:
        loop.close()
