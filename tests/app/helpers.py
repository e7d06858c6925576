"""Shared helpers for the app tests: SSE parsing, sign-up, a live uvicorn server in a thread."""
from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn


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
