"""Through a real uvicorn on 127.0.0.1: stopping mid-answer, a client that disconnects mid-stream,
one generation per conversation, readiness."""
from __future__ import annotations

import json
import time

import httpx


def conversation(http, headers) -> str:
    return http.post("/conversations", headers=headers).json()["id"]


def sse_events(response: httpx.Response):
    """Yield (id, event, data) as the events arrive."""
    ev_id = ev_name = None
    for line in response.iter_lines():
        if line.startswith("id: "):
            ev_id = line[4:]
        elif line.startswith("event: "):
            ev_name = line[7:]
        elif line.startswith("data: "):
            yield ev_id, ev_name, json.loads(line[6:])
            ev_id = ev_name = None


def wait_for(predicate, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def engine_stats(http, headers) -> dict:
    return http.get("/admin/stats", headers=headers).json()["backend"]


def test_stop_mid_answer_saves_the_partial_answer_and_frees_the_engine(http, admin):
    cid = conversation(http, admin)
    received = []
    # Greedy on the random model never emits EOS: without a stop this would run for 1500 tokens.
    with http.stream("POST", f"/conversations/{cid}/messages", headers=admin,
                     json={"text": "Tell me a very long story", "max_tokens": 1500}) as r:
        assert r.status_code == 200
        events = sse_events(r)
        for _, _, data in events:
            received.append(data["token"])
            if len(received) == 5:
                break
        stop = http.post(f"/conversations/{cid}/stop", headers=admin)
        assert stop.status_code == 200 and stop.json()["stopped"] is True
        # By the time /stop answers, the engine has dropped the request and freed its blocks.
        stats = engine_stats(http, admin)
        assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
        assert stats["kv_cache_usage_perc"] == 0
        rest = list(events)
    tokens = received + [d["token"] for _, _, d in rest if "token" in d]
    done = rest[-1][2]
    assert done["done"] is True and done["finish_reason"] == "abort" and done["status"] == "stopped"
    assert done["message_id"] == stop.json()["message_id"]
    assert 5 <= done["usage"]["completion_tokens"] < 1500

    answer = http.get(f"/conversations/{cid}", headers=admin).json()["messages"][-1]
    assert answer["status"] == "stopped" and answer["finish_reason"] == "abort"
    assert answer["text"] == "".join(tokens) and answer["text"]
    # The conversation is free again.
    r = http.post(f"/conversations/{cid}/messages", headers=admin, json={"text": "short one", "max_tokens": 3})
    assert r.status_code == 200 and '"done": true' in r.text


def test_disconnected_client_still_gets_its_answer_saved(http, admin):
    cid = conversation(http, admin)
    seen = []
    with httpx.Client(base_url=http.base_url, timeout=30) as other:
        with other.stream("POST", f"/conversations/{cid}/messages", headers=admin,
                          json={"text": "Answer slowly", "max_tokens": 400}) as r:
            message_id = r.headers["x-message-id"]
            for _, _, data in sse_events(r):
                seen.append(data["token"])
                if len(seen) == 3:
                    break
        # Leaving the block closed the connection mid-stream.

    def saved():
        msgs = http.get(f"/conversations/{cid}", headers=admin).json()["messages"]
        answer = next(m for m in msgs if m["id"] == message_id)
        return answer if answer["finish_reason"] else None

    answer = wait_for(saved)
    assert answer["status"] == "incomplete" and answer["finish_reason"] == "length"
    assert answer["text"].startswith("".join(seen)) and len(answer["text"]) > len("".join(seen))


def test_one_generation_at_a_time_per_conversation(http, admin):
    cid = conversation(http, admin)
    with http.stream("POST", f"/conversations/{cid}/messages", headers=admin,
                     json={"text": "long", "max_tokens": 1500}) as r:
        events = sse_events(r)
        next(events)
        busy = http.post(f"/conversations/{cid}/messages", headers=admin, json={"text": "again"})
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "generation_in_progress"
        conv = http.get(f"/conversations/{cid}", headers=admin).json()
        assert conv["generating"] == r.headers["x-message-id"]
        assert len(conv["messages"]) == 2  # the refused message was not saved
        # Deleting a conversation stops its generation first.
        assert http.delete(f"/conversations/{cid}", headers=admin).status_code == 204
        assert list(events)[-1][2]["finish_reason"] == "abort"
    assert http.get(f"/conversations/{cid}", headers=admin).status_code == 404
    assert engine_stats(http, admin)["num_requests_running"] == 0


def test_health_over_http(http):
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").status_code == 200
