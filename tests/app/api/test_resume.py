"""Resumable streams: Last-Event-ID after a dropped connection gives every event exactly once;
several clients can follow one generation; a finished one replays the rest and its end."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from chatloom.app.main import create_app

from app_testing import LiveServer, make_settings
from traffic_testing import ScriptedBackend

PIECES = [f" w{i}" for i in range(30)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    backend = ScriptedBackend(PIECES, delay_s=0.03)
    settings = make_settings(tmp_path_factory.mktemp("resume"), moderation={"mode": "off"}, sampling={"max_tokens": 64})
    with LiveServer(create_app(settings, backend)) as live:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            r = http.post("/auth/signup", json={"username": "alice", "password": "correct horse"})
            yield http, {"Authorization": f"Bearer {r.json()['token']}"}


def read_events(response: httpx.Response, limit: int | None = None) -> list[tuple[int, str | None, dict]]:
    out, ev_id, name = [], None, None
    for line in response.iter_lines():
        if line.startswith("id: "):
            ev_id = int(line[4:])
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((ev_id, name, json.loads(line[6:])))
            ev_id = name = None
            if limit is not None and len(out) >= limit:
                break
    return out


def text_of(events) -> str:
    return "".join(d.get("token", "") for _, _, d in events)


def test_resume_after_a_dropped_connection_gives_every_event_once(server):
    http, alice = server
    cid = http.post("/conversations", headers=alice).json()["id"]
    with http.stream("POST", f"/conversations/{cid}/messages", headers=alice, json={"text": "go"}) as r:
        first = read_events(r, limit=5)  # then the connection drops
    last_id = first[-1][0]
    with http.stream("GET", f"/conversations/{cid}/stream", headers={**alice, "Last-Event-ID": str(last_id)}) as r:
        assert r.status_code == 200
        rest = read_events(r)
    ids = [i for i, _, _ in first + rest]
    assert ids == list(range(1, len(ids) + 1))  # no gap, no repeat
    assert text_of(first + rest) == "".join(PIECES)
    assert rest[-1][2]["done"] is True and rest[-1][2]["finish_reason"] == "stop"

    # Finished: a late resume (query parameter this time) replays what is left and the end.
    r = http.get(f"/conversations/{cid}/stream", headers=alice, params={"last_event_id": ids[-3]})
    tail = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert len(tail) == 2 and tail[-1]["done"] is True


def test_two_clients_follow_one_generation(server):
    http, alice = server
    cid = http.post("/conversations", headers=alice).json()["id"]
    seen: dict[str, list] = {}

    def follow(name: str) -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=30) as other:
            with other.stream("GET", f"/conversations/{cid}/stream", headers=alice) as r:
                seen[name] = read_events(r)

    with http.stream("POST", f"/conversations/{cid}/messages", headers=alice, json={"text": "go"}) as r:
        threads = [threading.Thread(target=follow, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        own = read_events(r)
    for t in threads:
        t.join(10)
    assert seen["a"] == seen["b"] == own
    assert text_of(own) == "".join(PIECES)


def test_resume_errors_are_4xx(server):
    http, alice = server
    cid = http.post("/conversations", headers=alice).json()["id"]
    r = http.get(f"/conversations/{cid}/stream", headers=alice)
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
    r = http.get(f"/conversations/{cid}/stream", headers={**alice, "Last-Event-ID": "abc"})
    assert r.status_code == 400
    assert http.get("/conversations/conv_nope/stream", headers=alice).status_code == 404
    other = http.post("/auth/signup", json={"username": "mallory", "password": "correct horse"}).json()["token"]
    assert http.get(f"/conversations/{cid}/stream", headers={"Authorization": f"Bearer {other}"}).status_code == 404
