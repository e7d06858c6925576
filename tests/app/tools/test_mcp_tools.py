"""MCP servers as chat tools: a real server written with the SDK (mcp_test_server.py), over stdio and
over streamable HTTP. The chat's answer carries a result only that server can give; the server's
tools reach the model with their schemas; killing the server mid-call, a call that runs past the
timeout, or a server that is down or answers garbage, is a tool error the model reads, never a failed
answer."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chatloom.app.tools.mcp_servers import McpServer
from chatloom.app.tools.registry import ToolFailure
from chatloom.settings.tree import McpServerSettings

from app_testing import (ToolCallingBackend, app_client, call_text, done_of, free_port, make_settings,
                         new_conversation, send, signup, tokens_of)
from fake_web import fake_web

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
SECRET = "otter-7c1d"


def _code(label: str) -> str:
    return f"vault code for {label}: {hashlib.sha256(f'{SECRET}:{label}'.encode()).hexdigest()[:12]}"


def _result(events) -> dict:
    return next(e.data["tool_result"] for e in events if isinstance(e.data, dict) and "tool_result" in e.data)


@pytest.fixture
def http_server():
    """The test server over streamable HTTP on a free loopback port, killed at the end."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], env={**os.environ, "MCP_TEST_SECRET": SECRET},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:  # wait until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the MCP test server did not start"
            time.sleep(0.1)
    yield proc, f"http://127.0.0.1:{port}/mcp"
    proc.kill()
    proc.wait()


def _stdio() -> dict:
    return {"name": "vault", "command": [sys.executable, SERVER, "stdio"], "env": {"MCP_TEST_SECRET": SECRET}}


def _settings(tmp_path, server: dict, timeout_s: float = 30.0):
    return make_settings(tmp_path, chat={"tools": ""}, sampling={"max_tokens": 2000},
                         tools={"mcp_servers": [server], "mcp_timeout_s": timeout_s})


async def _ask_vault(tmp_path, server: dict) -> None:
    backend = ToolCallingBackend()
    async with app_client(_settings(tmp_path, server), backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        _, events = await send(client, alice, cid, call_text("vault__vault_code", label="alpha"))
        assert _result(events) == {"id": _result(events)["id"], "name": "vault__vault_code",
                                   "output": _code("alpha"), "error": None}
        assert tokens_of(events) == f"Result: {_code('alpha')}" and done_of(events)["status"] == "complete"
        # The server's tools reached the model with their own schemas.
        listing = backend.requests[0].messages[0]["content"]
        offered = [json.loads(line) for line in listing.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()]
        vault = next(t["function"] for t in offered if t["function"]["name"] == "vault__vault_code")
        assert vault["parameters"]["properties"]["label"]["type"] == "string"
        assert vault["parameters"]["required"] == ["label"]
        assert {t["function"]["name"] for t in offered} == {"vault__vault_code", "vault__hang", "vault__slow",
                                                         "vault__header"}


async def test_a_stdio_server_answers_in_the_chat(tmp_path):
    await _ask_vault(tmp_path, _stdio())


async def test_an_http_server_answers_in_the_chat_with_the_configured_headers(tmp_path, http_server):
    _, url = http_server
    await _ask_vault(tmp_path, {"name": "vault", "url": url, "headers": {"X-Team": "blue"}})
    server = McpServer(McpServerSettings(name="vault", url=url, headers={"X-Team": "blue"}), 30.0, 60.0)
    assert await server.call("header", {"name": "x-team"}) == "x-team: blue"


async def _kill_mid_call(tmp_path, server: dict, kill) -> None:
    pid_file = tmp_path / "hang.pid"
    async with app_client(_settings(tmp_path, server), ToolCallingBackend()) as (client, app, alice):
        cid = await new_conversation(client, alice)
        answer = asyncio.create_task(send(client, alice, cid, call_text("vault__hang", pid_file=str(pid_file))))
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):  # the call is inside the server
            assert not answer.done() and time.monotonic() < deadline
            await asyncio.sleep(0.05)
        kill(int(pid_file.read_text()))
        _, events = await asyncio.wait_for(answer, 60)
        result = _result(events)
        assert result["error"].startswith("the MCP server vault failed")
        assert done_of(events)["status"] == "complete"
        assert tokens_of(events).startswith("Result: error: the MCP server vault failed")
        assert 'chatloom:tool_calls_total{outcome="error",tool="mcp"} 1.0' in (await client.get("/metrics")).text


async def test_killing_a_stdio_server_mid_call_is_a_tool_error(tmp_path):
    await _kill_mid_call(tmp_path, _stdio(), lambda pid: os.kill(pid, signal.SIGKILL))


async def test_killing_an_http_server_mid_call_is_a_tool_error(tmp_path, http_server):
    proc, url = http_server
    await _kill_mid_call(tmp_path, {"name": "vault", "url": url}, lambda pid: proc.kill())


def _gone(pid: int) -> bool:
    """The process has ended (a zombie counts: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


async def _too_slow(tmp_path, server: dict, timeout_s: float) -> int:
    """A call that runs past the timeout, then a normal call in the same conversation; the slow call's server pid."""
    pid_file = tmp_path / "slow.pid"
    async with app_client(_settings(tmp_path, server, timeout_s), ToolCallingBackend()) as (client, app, alice):
        cid = await new_conversation(client, alice)
        # The tool sleeps far past the timeout: the answer ends when the timeout does, not when the tool would.
        _, events = await asyncio.wait_for(
            send(client, alice, cid, call_text("vault__slow", seconds=120, pid_file=str(pid_file))), 60)
        assert pid_file.read_text()  # the call reached the server
        reason = f"the MCP server vault failed: no answer within {timeout_s:g} s"
        assert _result(events)["error"] == reason
        assert tokens_of(events) == f"Result: error: {reason}" and done_of(events)["status"] == "complete"
        _, events = await send(client, alice, cid, call_text("vault__vault_code", label="after"))
        assert _result(events)["error"] is None and tokens_of(events) == f"Result: {_code('after')}"
        metrics = (await client.get("/metrics")).text
        assert 'chatloom:tool_calls_total{outcome="error",tool="mcp"} 1.0' in metrics
        assert 'chatloom:tool_calls_total{outcome="ok",tool="mcp"} 1.0' in metrics
    return int(pid_file.read_text())


async def test_a_stdio_call_past_the_timeout_is_a_tool_error_and_its_server_is_stopped(tmp_path):
    # Each stdio call starts the server: the timeout leaves room for Python to start and import the SDK.
    pid = await _too_slow(tmp_path, _stdio(), 6.0)
    deadline = time.monotonic() + 10
    while not _gone(pid):  # the timed-out call's server was stopped, not left sleeping
        assert time.monotonic() < deadline, f"the slow MCP server {pid} is still running"
        await asyncio.sleep(0.05)


async def test_an_http_call_past_the_timeout_is_a_tool_error_and_the_server_answers_again(tmp_path, http_server):
    proc, url = http_server
    assert await _too_slow(tmp_path, {"name": "vault", "url": url}, 2.0) == proc.pid
    assert proc.poll() is None  # the same server, still up


async def test_a_server_down_or_answering_garbage_is_a_tool_error(tmp_path):
    down = McpServer(McpServerSettings(name="down", url=f"http://127.0.0.1:{free_port()}/mcp"), 5.0, 60.0)
    assert await down.tools() == []  # not offered
    with pytest.raises(ToolFailure, match="the MCP server down failed: .*Connect"):
        await down.call("anything", {})
    with fake_web() as web:  # an HTTP server that is no MCP server
        garbage = McpServer(McpServerSettings(name="junk", url=f"{web.base}/garbage/search"), 5.0, 60.0)
        assert await garbage.tools() == []
        with pytest.raises(ToolFailure, match="the MCP server junk failed"):
            await garbage.call("anything", {})
    broken = McpServer(McpServerSettings(name="broken", command=[sys.executable, "-c", "print('not json')"]), 5.0, 60.0)
    with pytest.raises(ToolFailure, match="the MCP server broken failed"):
        await broken.call("anything", {})
    # An answer goes on without the tools of a server that is down.
    backend = ToolCallingBackend()
    settings = _settings(tmp_path, {"name": "down", "url": f"http://127.0.0.1:{free_port()}/mcp"})
    async with app_client(settings, backend) as (client, app, alice):
        _, events = await send(client, alice, await new_conversation(client, alice), "hello")
        assert tokens_of(events) == "No tools needed." and "<tools>" not in backend.requests[0].messages[0]["content"]


async def test_users_add_their_own_http_servers_held_to_the_fetch_rules(tmp_path, http_server):
    _, url = http_server
    backend = ToolCallingBackend()
    settings = make_settings(tmp_path, chat={"tools": ""}, sampling={"max_tokens": 2000},
                             tools={"mcp_user_servers": True, "fetch_allow": ["127.0.0.1"]})
    async with app_client(settings, backend) as (client, app, alice):
        bob = await signup(client, "bob")
        r = await client.post("/mcp-servers", headers=alice,
                              json={"name": "mine", "url": url, "headers": {"X-Team": "red"}})
        assert r.status_code == 201, r.text
        assert r.json()["header_names"] == ["X-Team"] and "red" not in r.text  # tokens never come back
        r = await client.post("/mcp-servers", headers=alice, json={"name": "mine", "url": url})
        assert r.status_code == 409
        cid = await new_conversation(client, alice)
        _, events = await send(client, alice, cid, call_text("mine__vault_code", label="beta"))
        assert tokens_of(events) == f"Result: {_code('beta')}"
        _, events = await send(client, alice, cid, call_text("mine__header", name="x-team"))
        assert tokens_of(events) == "Result: x-team: red"
        # Bob is not offered Alice's server, and cannot call it by name.
        _, events = await send(client, bob, await new_conversation(client, bob), call_text("mine__vault_code",
                                                                                           label="beta"))
        assert "mine__" not in backend.requests[-1].messages[0]["content"]
        assert _code("beta") not in tokens_of(events)
        assert (await client.get("/mcp-servers", headers=bob)).json() == []
        server_id = (await client.get("/mcp-servers", headers=alice)).json()[0]["id"]
        assert (await client.delete(f"/mcp-servers/{server_id}", headers=bob)).status_code == 404
        assert (await client.delete(f"/mcp-servers/{server_id}", headers=alice)).status_code == 204
        assert (await client.get("/mcp-servers", headers=alice)).json() == []

    # Without the allow-list, a user's server on loopback is refused when added, and when reached.
    settings = make_settings(tmp_path / "strict", chat={"tools": ""}, tools={"mcp_user_servers": True})
    async with app_client(settings, backend) as (client, app, alice):
        r = await client.post("/mcp-servers", headers=alice, json={"name": "mine", "url": url})
        assert r.status_code == 400 and "private, loopback or link-local" in r.json()["error"]["message"]
        for bad in ("http://169.254.169.254/mcp", f"http://[::1]:{free_port()}/mcp", "file:///etc/passwd"):
            assert (await client.post("/mcp-servers", headers=alice, json={"name": "x", "url": bad})).status_code == 400
    from chatloom.app.core.safe_fetch import FetchPolicy
    sneaky = McpServer(McpServerSettings(name="mine", url=url), 5.0, 60.0, FetchPolicy())
    assert await sneaky.tools() == []
    with pytest.raises(ToolFailure, match="private, loopback or link-local"):
        await sneaky.call("vault_code", {"label": "beta"})

    settings = make_settings(tmp_path / "off", chat={"tools": ""})
    async with app_client(settings, backend) as (client, app, alice):
        r = await client.post("/mcp-servers", headers=alice, json={"name": "mine", "url": url})
        assert r.status_code == 403 and r.json()["error"]["code"] == "mcp_servers_disabled"
