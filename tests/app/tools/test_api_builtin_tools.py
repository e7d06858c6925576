"""Built-in tool types on the Responses API, through the official `openai` package: code_interpreter runs
real code in the sandbox, web_search asks the loopback fake SearXNG, file_search searches an uploaded
file's collection, mcp calls a real MCP server (made with the `mcp` SDK) over HTTP; each streamed and not,
with OpenAI's output items and events, beside function tools the client runs. A scripted model drives
the calls (tool_backend.py); a built-in that is off or not configured is a 400 naming the problem."""
from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import socket
from contextlib import asynccontextmanager

import httpx
import openai
import pytest

from chatloom.app.main import create_app
from chatloom.serving import Delta
from chatloom.app.tools.code_interpreter import CodeInterpreter
from chatloom.settings.tree import ToolsSettings

from app_testing import ToolCallingBackend, call_text, free_port, make_settings, signup
from fake_web import fake_web

MCP_SERVER = os.path.join(os.path.dirname(__file__), "mcp_test_server.py")
SECRET = "otter-7c1d"
ZOO = ("# The zoo\n\nThe zebra quagga lives on the savanna and eats grass all day. " * 3).encode()
ADD = {"type": "function", "name": "add", "description": "Add two numbers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}


@asynccontextmanager
async def api(tmp_path, backend=None, **groups):
    """The app over ASGI with the scripted model; yields (http, SDK client for alice, alice's headers, backend)."""
    backend = backend or ToolCallingBackend()
    settings = make_settings(tmp_path, sampling={"max_tokens": 2000}, moderation={"mode": "off"}, **groups)
    app = create_app(settings, backend)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as http:
            headers = await signup(http, "alice")
            key = (await http.post("/auth/api-keys", headers=headers, json={"name": "sdk"})).json()["key"]
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=http, max_retries=0)
            yield http, client, headers, backend


async def both(client, **body):
    """The response whole, then streamed: (whole, the streamed events, the final response of the stream)."""
    whole = await client.responses.create(model="scripted", **body)
    events = [e async for e in await client.responses.create(model="scripted", stream=True, **body)]
    return whole, events, events[-1].response


def types(events) -> list[str]:
    return [e.type for e in events]


def _sandbox_or_skip() -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed (apt-get install bubblewrap)")
    problem = CodeInterpreter(ToolsSettings(), "/tmp").sandbox.problem()
    if problem:
        pytest.skip(f"the sandbox cannot run here: {problem}")


async def test_code_interpreter_runs_real_code_in_the_sandbox(tmp_path):
    _sandbox_or_skip()
    async with api(tmp_path) as (http, client, headers, backend):
        body = {"input": call_text("python", code="import math\nprint(math.factorial(12))"),
                "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}],
                "include": ["code_interpreter_call.outputs"]}
        whole, events, streamed = await both(client, **body)
        for response in (whole, streamed):
            call, message = response.output
            assert call.type == "code_interpreter_call" and call.status == "completed"
            assert call.code == "import math\nprint(math.factorial(12))"
            assert call.outputs[0].type == "logs" and call.outputs[0].logs == "479001600\n"
            assert response.output_text == "Result: stdout:\n479001600\n"
            assert response.tools[0].type == "code_interpreter"
        assert types(events)[2:10] == [
            "response.output_item.added", "response.code_interpreter_call.in_progress",
            "response.code_interpreter_call_code.delta", "response.code_interpreter_call_code.done",
            "response.code_interpreter_call.interpreting", "response.code_interpreter_call.completed",
            "response.output_item.done", "response.output_item.added"]
        # The thread keeps the result: a next turn shows the model the earlier call and what it printed.
        await client.responses.create(model="scripted", input="and then?", previous_response_id=whole.id)
        turns = backend.requests[-1].messages
        assert any(m["role"] == "tool" and "479001600" in m["content"] for m in turns)
        # A plot comes back as an image output, its bytes the caller's file.
        plot = await client.responses.create(
            model="scripted", tools=body["tools"], include=body["include"],
            input=call_text("python", code="import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nprint('ok')"))
        logs, image = plot.output[0].outputs
        assert (logs.type, logs.logs, image.type) == ("logs", "ok\n", "image")
        png = await http.get(image.url, headers={"Authorization": f"Bearer {client.api_key}"})
        assert png.status_code == 200 and png.content.startswith(b"\x89PNG")
        # A failing program: the item fails, the model reads the error and answers.
        failed = await client.responses.create(model="scripted", input=call_text("python", code="1/0"),
                                               tools=body["tools"], include=body["include"])
        assert failed.output[0].status == "failed" and "ZeroDivisionError" in failed.output[0].outputs[0].logs
        assert failed.status == "completed" and "ZeroDivisionError" in failed.output_text
        assert not os.listdir(tmp_path / "sandbox") or all(not n.startswith("resp_")
                                                          for n in os.listdir(tmp_path / "sandbox"))


async def test_web_search_asks_the_search_service(tmp_path):
    with fake_web() as web:
        async with api(tmp_path, tools={"search_url": web.base}) as (http, client, headers, backend):
            body = {"input": call_text("web_search", query="danube otters"), "tools": [{"type": "web_search"}],
                    "include": ["web_search_call.action.sources"]}
            whole, events, streamed = await both(client, **body)
            for response in (whole, streamed):
                call, message = response.output
                assert call.type == "web_search_call" and call.status == "completed"
                assert call.action.query == "danube otters"
                assert f"{web.base}/article" in [s.url for s in call.action.sources]
                assert f"{web.base}/article" in response.output_text  # the answer cites the URL
            assert web.searches == ["danube otters"] * 2
            key = client.api_key
            stored = (await http.get(f"/v1/responses/{whole.id}", headers={"Authorization": f"Bearer {key}"})).json()
            assert stored["output"][0] == whole.output[0].model_dump(exclude_unset=True)  # no hidden keys
            metrics = (await http.get("/metrics")).text
            assert 'chatloom:tool_calls_total{outcome="ok",tool="web_search"} 2.0' in metrics
            assert "'_call'" not in str(stored) and "'_call'" not in str([e.model_dump() for e in events])
            assert types(events)[3:6] == ["response.web_search_call.in_progress",
                                          "response.web_search_call.searching", "response.web_search_call.completed"]
            # A client that keeps the thread itself sends the items back: the model sees the call again.
            thread = [it.model_dump(exclude_none=True) for it in whole.output] + [{"role": "user", "content": "more"}]
            await client.responses.create(model="scripted", input=thread, store=False, tools=body["tools"])
            call_turn, tool_turn = backend.requests[-1].messages[-4:-2]
            assert '"name": "web_search"' in call_turn["content"] and "danube otters" in call_turn["content"]
            assert tool_turn == {"role": "tool", "content": f"sources: {web.base}/article, {web.base}/notes.txt"}
            # The preview alias; without include, no sources.
            other = await client.responses.create(model="scripted", input=body["input"],
                                                  tools=[{"type": "web_search_preview"}])
            assert other.output[0].type == "web_search_call" and not getattr(other.output[0].action, "sources", None)


async def test_file_search_over_an_uploaded_file(tmp_path, db_url):
    async with api(tmp_path, server={"db_url": db_url}) as (http, client, headers, backend):
        coll = (await http.post("/collections", headers=headers, json={"name": "zoo"})).json()["id"]
        r = await http.post("/files", headers=headers, files={"file": ("zoo.md", ZOO)}, data={"collection_id": coll})
        file_id = r.json()["id"]
        body = {"input": call_text("file_search", query="zebra quagga"),
                "tools": [{"type": "file_search", "vector_store_ids": [coll]}],
                "include": ["file_search_call.results"]}
        whole, events, streamed = await both(client, **body)
        for response in (whole, streamed):
            call, message = response.output
            assert call.type == "file_search_call" and call.queries == ["zebra quagga"]
            assert [(x.file_id, x.filename) for x in call.results] == [(file_id, "zoo.md")]
            assert "savanna" in call.results[0].text
            assert response.output_text.startswith("Result: [1] zoo.md:\n# The zoo")
        assert "response.file_search_call.searching" in types(events)
        plain = await client.responses.create(model="scripted", input=body["input"], tools=body["tools"])
        assert plain.output[0].results is None  # results only when include asks
        # Bob's collection is no vector store of alice's.
        bob = await signup(http, "bob")
        theirs = (await http.post("/collections", headers=bob, json={"name": "diary"})).json()["id"]
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="scripted", input="hi",
                                          tools=[{"type": "file_search", "vector_store_ids": [theirs]}])
        assert f"you have no vector store (collection) {theirs!r}" in e.value.message


@pytest.fixture
def mcp_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, MCP_SERVER, "http", str(port)],
                            env={**os.environ, "MCP_TEST_SECRET": SECRET},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the MCP test server did not start"
            time.sleep(0.1)
    yield proc, f"http://127.0.0.1:{port}/mcp"
    proc.kill()
    proc.wait()


async def test_mcp_tools_of_a_server_the_request_names(tmp_path, mcp_url):
    _, mcp_url = mcp_url
    code = f"vault code for otters: {hashlib.sha256(f'{SECRET}:otters'.encode()).hexdigest()[:12]}"
    tools = {"mcp_user_servers": True, "fetch_allow": ["127.0.0.1"]}
    async with api(tmp_path, tools=tools) as (http, client, headers, backend):
        mcp = {"type": "mcp", "server_label": "vault", "server_url": mcp_url, "allowed_tools": ["vault_code"],
               "require_approval": "never", "headers": {"X-Token": "t0ken"}}
        body = {"input": call_text("vault__vault_code", label="otters"), "tools": [mcp, ADD]}
        whole, events, streamed = await both(client, **body)
        for response in (whole, streamed):
            listing, call, message = response.output
            assert listing.type == "mcp_list_tools" and [t.name for t in listing.tools] == ["vault_code"]
            assert call.type == "mcp_call" and call.name == "vault_code" and call.server_label == "vault"
            assert call.output == code and call.error is None
            assert response.output_text == f"Result: {code}"
            assert "headers" not in response.tools[0].model_dump(exclude_none=True)  # no secrets echoed
        assert types(events)[2:6] == ["response.output_item.added", "response.mcp_list_tools.in_progress",
                                      "response.mcp_list_tools.completed", "response.output_item.done"]
        assert "response.mcp_call_arguments.done" in types(events) and "response.mcp_call.completed" in types(events)
        # A function tool beside it is the client's: its call comes back to run, and the thread goes on.
        mine = await client.responses.create(model="scripted", input=call_text("add", a=2, b=3), tools=body["tools"])
        assert [it.type for it in mine.output] == ["mcp_list_tools", "function_call"]
        fc = mine.output[1]
        done = await client.responses.create(model="scripted", previous_response_id=mine.id, tools=body["tools"],
                                             input=[{"type": "function_call_output", "call_id": fc.call_id,
                                                     "output": "5"}])
        assert done.output_text == "Result: 5"
        # A tool the request did not allow is not offered.
        hidden = await client.responses.create(model="scripted", input=call_text("vault__header", name="x-token"),
                                               tools=[mcp])
        assert [it.type for it in hidden.output] == ["mcp_list_tools", "message"]


async def test_a_builtin_off_or_not_configured_is_a_400_naming_it(tmp_path):
    async with api(tmp_path, tools={"api_tools": ["file_search"]}) as (http, client, headers, backend):
        cases = [([{"type": "web_search"}], "the web_search tool is turned off on this server (tools.api_tools)"),
                 ([{"type": "code_interpreter", "container": {"type": "auto"}}], "code_interpreter tool is turned off"),
                 ([{"type": "file_search", "vector_store_ids": []}], "must name at least one vector store"),
                 ([{"type": "image_generation"}], "tools[0] is of type 'image_generation'")]
        for tools, named in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model="scripted", input="hi", tools=tools)
            assert named in e.value.message
    async with api(tmp_path / "b") as (http, client, headers, backend):
        cases = [([{"type": "web_search_preview"}], "it has no search service (tools.search_url)"),
                 ([{"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:9/mcp",
                    "require_approval": "never"}], "MCP servers named in requests are not allowed on this server"),
                 ([{"type": "code_interpreter", "container": "cntr_123"}], "only {\"type\": \"auto\"}"),
                 ([{"type": "function", "name": "web_search", "parameters": {"type": "object"}},
                   {"type": "file_search", "vector_store_ids": ["coll_x"]}], "no vector store (collection) 'coll_x'")]
        for tools, named in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model="scripted", input="hi", tools=tools)
            assert named in e.value.message
    async with api(tmp_path / "c", tools={"mcp_user_servers": True}) as (http, client, headers, backend):
        mcp = {"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:9/mcp"}
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="scripted", input="hi", tools=[mcp])
        assert "require_approval must be \"never\"" in e.value.message
        with pytest.raises(openai.APIStatusError) as e:  # loopback, not allow-listed: it cannot be listed
            await client.responses.create(model="scripted", input="hi", tools=[{**mcp, "require_approval": "never"}])
        assert e.value.status_code == 424 and "cannot list the tools of the MCP server x" in e.value.message



class QuotingBackend(ToolCallingBackend):
    """Answers by quoting the first URL its system message holds (the search results)."""

    async def stream(self, request):
        self.requests.append(request)
        url = re.search(r"http://\S+", request.messages[0]["content"]).group(0)
        yield Delta(f"See {url} for it.")
        yield Delta("", True, "stop", 10, 4)


async def test_chat_completions_web_search_options(tmp_path):
    with fake_web() as web:
        async with api(tmp_path, QuotingBackend(), tools={"search_url": web.base}) as (http, client, headers, backend):
            messages = [{"role": "user", "content": "danube otters"}]
            done = await client.chat.completions.create(model="scripted", messages=messages, web_search_options={})
            assert web.searches == ["danube otters"]
            system = backend.requests[-1].messages[0]["content"]
            assert "Web search results" in system and f"[1] Otters of the Danube\n{web.base}/article" in system
            url = f"{web.base}/article"
            message = done.choices[0].message
            assert message.content == f"See {url} for it."
            [note] = message.annotations
            assert note.type == "url_citation" and note.url_citation.url == url
            assert (note.url_citation.start_index, note.url_citation.end_index) == (4, 4 + len(url))
            assert note.url_citation.title == "Otters of the Danube"
            chunks = [c async for c in await client.chat.completions.create(
                model="scripted", messages=messages, web_search_options={"search_context_size": "low"}, stream=True)]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
            assert len(web.searches) == 2
    async with api(tmp_path / "off") as (http, client, headers, backend):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="scripted", messages=messages, web_search_options={})
        assert "it has no search service (tools.search_url)" in e.value.message


async def test_an_mcp_server_killed_mid_call_is_a_failed_item_not_a_failed_response(tmp_path, mcp_url):
    proc, url = mcp_url
    pid_file = tmp_path / "pid"
    tools = {"mcp_user_servers": True, "fetch_allow": ["127.0.0.1"]}
    async with api(tmp_path, tools=tools) as (http, client, headers, backend):
        mcp = {"type": "mcp", "server_label": "vault", "server_url": url, "require_approval": "never"}
        stream = await client.responses.create(model="scripted", tools=[mcp], stream=True,
                                               input=call_text("vault__hang", pid_file=str(pid_file)))
        reading = asyncio.ensure_future(_collect(stream))
        while not (pid_file.exists() and pid_file.read_text()):  # the call is inside the server
            assert not reading.done()
            await asyncio.sleep(0.05)
        proc.kill()
        events = await asyncio.wait_for(reading, 60)
        response = events[-1].response
        assert events[-1].type == "response.completed" and "response.mcp_call.failed" in types(events)
        call = response.output[1]
        assert call.type == "mcp_call" and call.status == "failed" and call.output is None
        assert call.error.startswith("the MCP server vault failed")
        assert response.output_text.startswith("Result: error: the MCP server vault failed")


async def _collect(stream) -> list:
    return [e async for e in stream]
