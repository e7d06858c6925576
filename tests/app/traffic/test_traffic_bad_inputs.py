"""Bad input to the traffic routes is a 4xx JSON error, never a 500."""
from __future__ import annotations

import pytest

from app_testing import new_conversation

CASES = [
    ("PUT", "/admin/users/alice/tier", b"{nope", 400),
    ("PUT", "/admin/users/alice/tier", {}, 422),
    ("PUT", "/admin/users/alice/tier", {"tier": ""}, 422),
    ("PUT", "/admin/users/alice/tier", {"tier": "pro", "x": 1}, 422),
    ("PUT", "/admin/reasoning", {"max_effort": None}, 422),
    ("PUT", "/admin/reasoning", b"[]", 422),
    ("POST", "/messages/msg_x/feedback", b"{", 400),
    ("POST", "/messages/msg_x/feedback", {"rating": "up", "text": "x" * 5000}, 422),
    ("POST", "/messages/msg_x/feedback", {"rating": 1}, 422),
    ("GET", "/usage?days=abc", None, 422),
    ("GET", "/usage?days=1000", None, 422),
    ("GET", "/admin/usage?days=-1", None, 422),
    ("GET", "/conversations/{cid}/stream?last_event_id=-3", None, 400),
    ("GET", "/conversations/{cid}/stream?last_event_id=1.5", None, 400),
    ("GET", "/conversations/{cid}/stream?message_id=" + "m" * 50, None, 422),
    ("POST", "/conversations/{cid}/messages", {"text": "hi", "reasoning_effort": "max"}, 422),
    ("POST", "/conversations/{cid}/messages", {"text": "hi", "reasoning_effort": 3}, 422),
    ("POST", "/v1/chat/completions", {"model": "tiny-random", "reasoning_effort": "turbo",
                                      "messages": [{"role": "user", "content": "x"}]}, 400),
]


@pytest.mark.parametrize("method,path,body,status", CASES, ids=[str(i) for i in range(len(CASES))])
async def test_bad_traffic_inputs(client, alice, method, path, body, status):
    cid = await new_conversation(client, alice)
    kwargs = {"headers": alice}
    if isinstance(body, bytes):
        kwargs = {"content": body, "headers": {**alice, "content-type": "application/json"}}
    elif body is not None:
        kwargs["json"] = body
    r = await client.request(method, path.format(cid=cid), **kwargs)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


async def test_bad_last_event_id_header(client, alice):
    cid = await new_conversation(client, alice)
    r = await client.get(f"/conversations/{cid}/stream", headers={**alice, "Last-Event-ID": "x" * 30})
    assert r.status_code == 422 and r.json()["error"]["param"]
