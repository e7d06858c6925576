"""Shared helpers for the app tests: settings, accounts, SSE parsing, a recording backend,
an app over ASGI, and a live uvicorn server in a thread.

(A uniquely named module: pytest puts this folder on sys.path, so test modules import it directly.)"""
from __future__ import annotations

import json
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
from chatloom.serving import Backend, GenerationRequest


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


@asynccontextmanager
async def app_client(settings, backend, **extra):
    app = create_app(settings, backend, **extra)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield client, app, await signup(client, "alice")
