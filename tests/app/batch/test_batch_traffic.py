"""Batch lines in traffic: a running batch request gives way to an interactive one that cannot start, and
runs again after; a batch goes on on another gateway (shared PostgreSQL and Redis) when its gateway stops,
whether it let its lease go or died holding it."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import AsyncExitStack
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from chatloom.app.main import create_app
from chatloom.store.batches import Batch, Batches
from sqlalchemy import update

from app_testing import make_settings, merge_groups, signup
from backing_services import create_database, drop_database, require_postgres, require_redis
from traffic_testing import ScriptedBackend, write_tiers

WORDS = [f" w{i}" for i in range(20)]


class FullWhileBusy(ScriptedBackend):
    """An engine with room for one request at a time."""

    def has_room(self, prompt_tokens: int) -> bool:
        return self.running == 0


def line(i: int, endpoint: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": endpoint,
                       "body": {"model": "scripted", "messages": [{"role": "user", "content": f"item {i}"}],
                                "max_tokens": 100}})


async def start_batch(client: httpx.AsyncClient, headers: dict, n: int) -> str:
    data = "\n".join(line(i) for i in range(n)).encode()
    r = await client.post("/v1/files", headers=headers, files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    r = await client.post("/v1/batches", headers=headers, json={"input_file_id": r.json()["id"],
                                                                "endpoint": "/v1/chat/completions",
                                                                "completion_window": "24h"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


async def chat_beside_a_batch(client: httpx.AsyncClient, backend: ScriptedBackend, headers: dict, n: int) -> str:
    """Start a batch of `n` lines, and once one of them is in the engine, chat: the chat must get its answer."""
    batch_id = await start_batch(client, headers, n)
    while backend.running == 0:
        await asyncio.sleep(0.005)
    r = await client.post("/v1/chat/completions", headers=headers, json={
        "model": "scripted", "messages": [{"role": "user", "content": "now"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    return batch_id


async def wait_batch(client, headers, batch_id, done, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        batch = (await client.get(f"/v1/batches/{batch_id}", headers=headers)).json()
        if done(batch):
            return batch
        assert time.monotonic() < deadline, (batch["status"], batch["request_counts"])
        await asyncio.sleep(0.02)


async def output_of(client, headers, batch: dict) -> list[dict]:
    r = await client.get(f"/v1/files/{batch['output_file_id']}/content", headers=headers)
    return [json.loads(x) for x in r.text.splitlines()]


async def test_a_batch_request_gives_way_to_interactive_work(tmp_path):
    backend = FullWhileBusy(WORDS, delay_s=0.02)
    settings = make_settings(tmp_path, batch={"concurrency": 1}, sampling={"max_tokens": 100})
    app = create_app(settings, backend)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        alice = await signup(client, "alice")
        batch_id = await chat_beside_a_batch(client, backend, alice, 3)
        # The batch request stopped for it (not finished: 20 words at 20 ms each), and ran again after it.
        assert len(backend.aborted) == 1
        prompts = [req.messages[-1]["content"] for req in backend.requests]
        assert prompts[:3] == ["item 0", "now", "item 0"], prompts
        batch = await wait_batch(client, alice, batch_id, lambda b: b["status"] == "completed")
        assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        out = await output_of(client, alice, batch)
        assert sorted(o["custom_id"] for o in out) == ["r0", "r1", "r2"]
        # The line that gave way ran again, whole.
        assert all(o["response"]["body"]["choices"][0]["message"]["content"] == "".join(WORDS) for o in out)


async def test_no_batch_line_starts_while_an_interactive_request_is_starting(tmp_path):
    backend = ScriptedBackend(WORDS[:3], delay_s=0.001)
    app = create_app(make_settings(tmp_path, sampling={"max_tokens": 100}), backend)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        alice = await signup(client, "alice")
        traffic = app.state.ctx.traffic
        # An interactive request admitted, its first output not out yet.
        starting = await traffic.admission.admit(traffic.tiers["free"], 1)
        batch_id = await start_batch(client, alice, 2)
        await wait_batch(client, alice, batch_id, lambda b: b["status"] == "in_progress")
        await asyncio.sleep(0.3)
        assert backend.requests == []
        starting.started()
        batch = await wait_batch(client, alice, batch_id, lambda b: b["status"] == "completed")
        assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
        starting.release()


@pytest.fixture
def pg_url():
    url = asyncio.run(create_database(require_postgres()))
    yield url
    asyncio.run(drop_database(url))


@pytest.mark.parametrize("how", ["stopped", "died"])
async def test_a_batch_goes_on_on_another_gateway(tmp_path, pg_url, how, monkeypatch):
    redis_url = require_redis()
    backend = ScriptedBackend(WORDS[:4], delay_s=0.02)
    shared = {"server": {"db_url": pg_url}, "batch": {"concurrency": 1, "lease_s": 30, "poll_s": 0.1},
              "shared_state": {"redis_url": redis_url, "prefix": f"t{uuid.uuid4().hex[:8]}", "job_lease_s": 0.5}}

    def gateway(name: str):
        return create_app(make_settings(tmp_path, **merge_groups(shared, {"shared_state": {"gateway_id": name}})),
                          backend)

    first = gateway("gw1")
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(first.router.lifespan_context(first))
        c1 = await stack.enter_async_context(httpx.AsyncClient(transport=httpx.ASGITransport(app=first),
                                                               base_url="http://gw1"))
        alice = await signup(c1, "alice")
        batch_id = await start_batch(c1, alice, 12)
        halfway = await wait_batch(c1, alice, batch_id, lambda b: b["request_counts"]["completed"] >= 3)
        if how == "died":  # it never lets its lease go: the next gateway sees its process is gone
            monkeypatch.setattr(Batches, "release", lambda *a, **k: asyncio.sleep(0))
    second = gateway("gw2")
    async with second.router.lifespan_context(second), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=second), base_url="http://gw2") as c2:
        assert halfway["request_counts"]["completed"] < 12 and halfway["status"] == "in_progress"
        batch = await wait_batch(c2, alice, batch_id, lambda b: b["status"] == "completed")
        out = await output_of(c2, alice, batch)
        assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(12))
        assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
        # Each line ran once, but for the one running when the first gateway stopped.
        assert 12 <= len(backend.requests) <= 13


async def test_a_line_the_quota_could_never_take_fails_instead_of_waiting(tmp_path):
    tiers = write_tiers(tmp_path, free={"tokens_per_minute": 200})
    settings = make_settings(tmp_path, traffic={"tiers_file": tiers}, batch={"quota_discount": 0.5})
    app = create_app(settings, ScriptedBackend(WORDS[:3]))
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        alice = await signup(client, "alice")
        data = "\n".join([line(0).replace('"max_tokens": 100', '"max_tokens": 400'),  # (5 + 400) / 2 > 200
                          line(1).replace('"max_tokens": 100', '"max_tokens": 300')]).encode()  # (5 + 300) / 2 fits
        r = await client.post("/v1/files", headers=alice, files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
        r = await client.post("/v1/batches", headers=alice, json={"input_file_id": r.json()["id"],
                                                                  "endpoint": "/v1/chat/completions",
                                                                  "completion_window": "24h"})
        batch = await wait_batch(client, alice, r.json()["id"], lambda b: b["status"] == "completed")
        assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
        r = await client.get(f"/v1/files/{batch['error_file_id']}/content", headers=alice)
        refused = json.loads(r.text)
        assert refused["custom_id"] == "r0" and refused["response"]["status_code"] == 400
        assert refused["response"]["body"]["error"]["code"] == "request_too_large"


async def test_a_running_batch_takes_none_of_its_owners_per_minute_limits(tmp_path):
    """More lines than the tier's requests per minute end in seconds, and their owner chats beside them on
    a tier that runs one generation at a time: batch lines count against the day's tokens only."""
    tiers = write_tiers(tmp_path, free={"requests_per_minute": 3, "max_concurrent": 1})
    backend = ScriptedBackend(WORDS, delay_s=0.01)
    settings = make_settings(tmp_path, traffic={"tiers_file": tiers}, batch={"concurrency": 2},
                             sampling={"max_tokens": 100})
    app = create_app(settings, backend)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        alice = await signup(client, "alice")
        batch_id = await chat_beside_a_batch(client, backend, alice, 8)
        batch = await wait_batch(client, alice, batch_id, lambda b: b["status"] == "completed", timeout=30)
        assert batch["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
        usage = (await client.get("/usage", headers=alice)).json()
        assert usage["totals"]["requests"] == 9  # every line metered, and the chat


async def test_lines_left_when_the_window_ends_go_to_the_error_file(tmp_path):
    settings = make_settings(tmp_path, batch={"concurrency": 1, "poll_s": 0.05}, sampling={"max_tokens": 100})
    app = create_app(settings, ScriptedBackend(WORDS, delay_s=0.01))
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        alice = await signup(client, "alice")
        batch_id = await start_batch(client, alice, 20)
        await wait_batch(client, alice, batch_id, lambda b: b["request_counts"]["completed"] >= 1)
        async with app.state.ctx.db.session() as session:  # the 24 hours are up
            await session.execute(update(Batch).where(Batch.id == batch_id)
                                  .values(expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)))
            await session.commit()
        batch = await wait_batch(client, alice, batch_id, lambda b: b["status"] == "expired")
        counts = batch["request_counts"]
        assert counts["total"] == 20 and counts["completed"] + counts["failed"] == 20 and counts["failed"] >= 1
        assert batch["expired_at"] and batch["output_file_id"]
        r = await client.get(f"/v1/files/{batch['error_file_id']}/content", headers=alice)
        left = [json.loads(x) for x in r.text.splitlines()]
        assert {e["error"]["code"] for e in left} == {"batch_expired"} and len(left) == counts["failed"]
        assert [e["error"]["line"] for e in left] == sorted(e["error"]["line"] for e in left)
