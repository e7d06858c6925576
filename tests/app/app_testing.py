"""Shared helpers for the app tests: settings, accounts, SSE parsing, a recording backend, a scripted
model that calls tools, an app over ASGI, and a live uvicorn server in a thread.

(A uniquely named module: pytest puts this folder on sys.path, so test modules import it directly.)"""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import uvicorn

from chatloom.app.main import create_app
from chatloom.app.chat.prompt import SUMMARIZER_SYSTEM
from chatloom.settings import Settings
from chatloom.serving import Backend, Delta, GenerationRequest


@dataclass
class Event:
    id: str | None
    event: str | None
    data: dict | str


def parse_sse(text: str) -> list[Event]:
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        ev_id = ev_name = None
        data_lines = []
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "id":
                ev_id = value
            elif field == "event":
                ev_name = value
            elif field == "data":
                data_lines.append(value)
        if data_lines:
            raw = "\n".join(data_lines)
            try:
                data = json.loads(raw)
            except ValueError:
                data = raw
            events.append(Event(ev_id, ev_name, data))
    return events


def tokens_of(events: list[Event]) -> str:
    return "".join(e.data["token"] for e in events if isinstance(e.data, dict) and "token" in e.data)


def done_of(events: list[Event]) -> dict:
    done = [e.data for e in events if isinstance(e.data, dict) and e.data.get("done")]
    assert len(done) == 1, events
    return done[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 in a background thread."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


# -- settings, accounts, conversations -------------------------------------------------

def make_settings(tmp_path, **overrides: dict) -> Settings:
    """Test settings; overrides are groups of the settings tree (`engine={"max_num_seqs": 2}`), merged
    key by key into these."""
    # Cheap argon2 parameters: the tests sign up many users; production keeps the defaults.
    base = {"server": {"data_dir": str(tmp_path)},
            "accounts": {"jwt_secret": "test-secret-0123456789abcdef0123456789", "argon2_time_cost": 1,
                         "argon2_memory_kib": 1024},
            "chat": {"system_prompt": "Be brief.", "tools": ""},  # tool tests turn tools on
            "sampling": {"max_tokens": 16, "temperature": 0.0},
            "shared_state": {"shutdown_grace_s": 0.0}}
    return Settings(**merge_groups(base, overrides))


def merge_groups(*layers: dict) -> dict:
    """Settings-tree groups merged key by key, later layers winning."""
    merged: dict = {}
    for layer in layers:
        for group, values in layer.items():
            merged.setdefault(group, {}).update(values)
    return merged


async def signup(client: httpx.AsyncClient, username: str, password: str = "correct horse") -> dict:
    r = await client.post("/auth/signup", json={"username": username, "password": password})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


async def new_conversation(client, headers, **body) -> str:
    r = await client.post("/conversations", headers=headers, json=body or None)
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def send(client, headers, cid, text, **extra):
    r = await client.post(f"/conversations/{cid}/messages", headers=headers, json={"text": text, **extra})
    assert r.status_code == 200, r.text
    return r, parse_sse(r.text)


# -- an app over ASGI, a backend that records what it was asked ------------------------

class RecordingBackend(Backend):
    """Delegates to a real backend and keeps every request it was given."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.requests: list[GenerationRequest] = []

    ready = property(lambda self: self.inner.ready)
    model_ids = property(lambda self: self.inner.model_ids)
    context_window = property(lambda self: self.inner.context_window)

    def count_tokens(self, text):
        return self.inner.count_tokens(text)

    def count_prompt_tokens(self, messages):
        return self.inner.count_prompt_tokens(messages)

    def takes_images(self, model=None):
        return self.inner.takes_images(model)

    def stream(self, request):
        self.requests.append(request)
        return self.inner.stream(request)

    def abort(self, request_id):
        self.inner.abort(request_id)

    def embedding_tokens(self, inputs, model=None):
        return self.inner.embedding_tokens(inputs, model)

    def embedding_size(self, model=None):
        return self.inner.embedding_size(model)

    async def embed(self, inputs, model=None):
        return await self.inner.embed(inputs, model)

    def summaries(self) -> list[GenerationRequest]:
        return [r for r in self.requests if r.messages[0]["content"] == SUMMARIZER_SYSTEM]

    def answers(self) -> list[GenerationRequest]:
        return [r for r in self.requests if r.messages[0]["content"] != SUMMARIZER_SYSTEM]


class ToolCallingBackend(Backend):
    """A scripted model for the tool loops. The last user message decides, when the prompt lists tools:
    `call NAME {json arguments}` calls NAME, `calculate X` the calculator, `remember that X` the remember
    tool, up to `calls_per_answer` times an answer (`preamble` before each call). After a tool turn it answers
    `Result: <the tool turn>`, otherwise `No tools needed.`. A token is a word; the text streams in pieces of
    `chunk` characters. Records every request and every KV-cache instruction (`kv`)."""

    def __init__(self, calls_per_answer: int = 1, preamble: str = "", chunk: int = 50) -> None:
        self.calls_per_answer, self.preamble, self.chunk = calls_per_answer, preamble, chunk
        self.requests: list[GenerationRequest] = []
        self.kv: list[tuple] = []

    ready = property(lambda self: True)
    model_ids = property(lambda self: ["scripted"])
    context_window = property(lambda self: 32768)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def count_prompt_tokens(self, messages: list[dict]) -> int:
        return sum(self.count_tokens(m["content"]) + 4 for m in messages)

    @staticmethod
    def asked(question: str) -> tuple[str, dict] | None:
        """The call a user message asks for, if any."""
        if m := re.match(r"call (\w+) (\{.*\})\s*$", question, re.S):
            return m.group(1), json.loads(m.group(2))
        if m := re.search(r"calculate (.+)", question):
            return "calculator", {"expression": m.group(1)}
        if m := re.search(r"remember that (.+)", question):
            return "remember", {"fact": m.group(1)}
        return None

    async def stream(self, request: GenerationRequest):
        self.requests.append(request)
        msgs = request.messages
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        calls_made = sum(m["role"] == "tool" for m in msgs[last_user:])
        asked = self.asked(msgs[last_user]["content"])
        if asked and "<tools>" in msgs[0]["content"] and calls_made < self.calls_per_answer:
            call = json.dumps({"name": asked[0], "arguments": asked[1]})
            text = f"{self.preamble}<tool_call>\n{call}\n</tool_call>"
        elif msgs[-1]["role"] == "tool":
            text = f"Result: {msgs[-1]['content']}"
        else:
            text = "No tools needed."
        for i in range(0, len(text), self.chunk):
            yield Delta(text[i:i + self.chunk])
        yield Delta("", True, "stop", self.count_prompt_tokens(msgs), len(text.split()))

    def abort(self, request_id: str) -> None:
        self.kv.append(("abort", request_id))

    def hold_kv(self, request_id: str, tools: list[str], policy: str, timeout_s: float) -> None:
        self.kv.append(("hold", request_id, tools, policy, timeout_s))

    def release_kv(self, request_id: str) -> None:
        self.kv.append(("release", request_id))


def call_text(tool: str, **arguments: object) -> str:
    """The user message that makes ToolCallingBackend call `tool` with `arguments`."""
    return f"call {tool} {json.dumps(arguments)}"


@asynccontextmanager
async def app_client(settings, backend, **extra):
    app = create_app(settings, backend, **extra)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield client, app, await signup(client, "alice")
