"""The admission queue: KV room decides, tiers order, reserved shares keep the free tier moving,
reasoning keeps to its share, a long wait is a 503 that cost no model work."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from chatloom.app.traffic.admission import BATCH, INTERACTIVE, REASONING, AdmissionQueue, QueueTimeout
from chatloom.app.main import create_app
from chatloom.engine import EngineConfig
from chatloom.app.traffic.tiers import DEFAULT_TIERS

from app_testing import make_settings, merge_groups, new_conversation, parse_sse, signup
from traffic_testing import ScriptedBackend, write_tiers

FREE, PLUS, PRO = DEFAULT_TIERS["free"], DEFAULT_TIERS["plus"], DEFAULT_TIERS["pro"]


async def test_room_in_the_engine_decides_when_the_next_request_starts():
    room = {"ok": False}
    q = AdmissionQueue(lambda tokens: room["ok"], max_running=8, max_wait_s=5, poll_s=0.005)
    task = asyncio.create_task(q.admit(PRO, 100))
    await asyncio.sleep(0.05)
    assert not task.done() and q.waiting == 1
    room["ok"] = True  # blocks freed inside the engine: the poller notices
    slot = await asyncio.wait_for(task, 1)
    assert q.running == 1 and q.waiting == 0
    slot.release()
    assert q.running == 0


async def test_higher_tiers_first_but_free_keeps_its_reserved_share():
    q = AdmissionQueue(lambda tokens: True, max_running=1, max_wait_s=30, share_window=10)
    order: list[str] = []
    first = await q.admit(PRO, 1)

    async def one(tier, label):
        slot = await q.admit(tier, 1)
        order.append(label)
        await asyncio.sleep(0)
        slot.release()

    tasks = [asyncio.create_task(one(PRO, f"pro{i}")) for i in range(20)]
    tasks += [asyncio.create_task(one(FREE, f"free{i}")) for i in range(3)]
    await asyncio.sleep(0)
    first.release()
    await asyncio.gather(*tasks)
    # Free keeps its 20 % share of admissions: all three are in long before the pros are done.
    free_at = [order.index(f"free{i}") for i in range(3)]
    assert max(free_at) < 16, order
    # ... but pro still gets most of the admissions while both wait.
    assert sum(1 for label in order[: max(free_at)] if label.startswith("pro")) >= 2 * 3, order


async def test_queue_positions_are_announced():
    q = AdmissionQueue(lambda tokens: True, max_running=1, max_wait_s=30)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    running = await q.admit(PRO, 1)

    async def wait(label, tier):
        async def position(n):
            seen[label].append(n)
        slot = await q.admit(tier, 1, on_position=position)
        slot.release()

    a = asyncio.create_task(wait("a", PLUS))
    await asyncio.sleep(0.01)
    b = asyncio.create_task(wait("b", PRO))  # overtakes a
    await asyncio.sleep(0.01)
    running.release()
    await asyncio.gather(a, b)
    assert seen["a"] == [1, 2, 1] and seen["b"] == [1]


async def test_reasoning_requests_keep_to_their_share():
    q = AdmissionQueue(lambda tokens: True, max_running=4, max_wait_s=30, reasoning_share=0.5)
    r1 = await q.admit(PRO, 1, REASONING)
    r2 = await q.admit(PRO, 1, REASONING)
    third = asyncio.create_task(q.admit(PRO, 1, REASONING))
    await asyncio.sleep(0.05)
    assert not third.done()  # 2 of 4 slots is the reasoning share
    chat = await asyncio.wait_for(q.admit(FREE, 1), 1)  # interactive chat still gets in
    r1.release()
    r3 = await asyncio.wait_for(third, 1)
    for s in (r2, r3, chat):
        s.release()


async def test_within_a_tier_the_nearest_ttft_deadline_goes_first():
    """A chat message overtakes a reasoning request of its tier that came first while the reasoning
    request's target leaves it time; tiers still outrank each other, and equal targets keep arrival order."""
    targets = {INTERACTIVE: 2.0, REASONING: 10.0}
    q = AdmissionQueue(lambda tokens: True, max_running=1, max_wait_s=30,
                       ttft_target=lambda tier, kind: targets[kind])
    running = await q.admit(PRO, 1)
    reasoning = q.enqueue(PLUS, 1, REASONING)
    chat = q.enqueue(PLUS, 1)
    chat_later = q.enqueue(PLUS, 1)
    pro_reasoning = q.enqueue(PRO, 1, REASONING)
    assert reasoning.deadline > chat.deadline  # 10 s from its arrival against 2 s from a later one
    assert q._order() == [pro_reasoning, chat, chat_later, reasoning]
    assert q.expected_wait(reasoning) is None  # (nothing measured yet)
    granted = []
    running.release()
    for ticket in (pro_reasoning, chat, chat_later, reasoning):
        slot = await q.wait(ticket)
        granted.append(slot.ticket)
        slot.release()
    assert granted == [pro_reasoning, chat, chat_later, reasoning]


async def test_without_targets_a_tier_waits_in_arrival_order():
    q = AdmissionQueue(lambda tokens: True, max_running=1, max_wait_s=30)
    running = await q.admit(PRO, 1)
    tickets = [q.enqueue(PLUS, 1, REASONING), q.enqueue(PLUS, 1), q.enqueue(PLUS, 1, REASONING)]
    assert q._order() == tickets
    running.release()
    for ticket in tickets:
        (await q.wait(ticket)).release()


async def test_the_gateway_orders_its_queue_by_the_configured_class_targets(tmp_path):
    app = traffic_app(tmp_path, ScriptedBackend(["x"]), traffic={"slo_ttft_s": 3.0, "slo_classes": {
        "interactive:free": {"ttft_s": 6.0}, "reasoning": {"ttft_s": 20.0}}})
    async with app.router.lifespan_context(app):
        target = app.state.ctx.traffic.admission.ttft_target
        assert target(FREE, INTERACTIVE) == 6.0  # its own class
        assert target(PRO, INTERACTIVE) == 3.0  # the service-wide target
        assert target(PRO, REASONING) == target(FREE, REASONING) == 20.0
        assert target(FREE, BATCH) == 3.0


async def test_a_request_that_waits_too_long_leaves_with_queue_timeout():
    q = AdmissionQueue(lambda tokens: False, max_running=4, max_wait_s=0.1, poll_s=0.01)
    with pytest.raises(QueueTimeout) as info:
        await q.admit(PRO, 10)
    assert info.value.retry_after >= 1 and q.waiting == 0 and q.running == 0


async def test_a_cancelled_waiter_leaves_the_queue():
    q = AdmissionQueue(lambda tokens: False, max_running=4, max_wait_s=5, poll_s=0.01)
    task = asyncio.create_task(q.admit(PRO, 10))
    await asyncio.sleep(0.03)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert q.waiting == 0


async def test_a_waiter_cancelled_as_its_slot_is_granted_hands_the_slot_back():
    room = {"ok": False}
    q = AdmissionQueue(lambda tokens: room["ok"], max_running=4, max_wait_s=5, poll_s=3600)
    task = asyncio.create_task(q.admit(PRO, 10))
    while q.waiting == 0:
        await asyncio.sleep(0)
    await asyncio.sleep(0)  # into its wait
    room["ok"] = True
    q._dispatch()  # the slot is granted ...
    task.cancel()  # ... and the request is cancelled in the same turn of the loop
    with pytest.raises(asyncio.CancelledError):
        await task
    assert q.running == 0 and q.waiting == 0


def traffic_app(tmp_path, backend, **settings):
    tiers = write_tiers(tmp_path, free={"max_concurrent": 50, "requests_per_minute": 1000},
                        pro={"max_concurrent": 50})
    return create_app(make_settings(tmp_path, **merge_groups(
        {"traffic": {"tiers_file": tiers}, "moderation": {"mode": "off"}}, settings)), backend)


async def test_free_tier_is_served_under_a_flood_of_paid_requests(tmp_path):
    backend = ScriptedBackend(["a", " b"], delay_s=0.01)
    app = traffic_app(tmp_path, backend, traffic={"admission_max_running": 1})
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as c:
            root = await signup(c, "root")
            payers = []
            for i in range(4):
                payers.append(await signup(c, f"payer{i}"))
                await c.put(f"/admin/users/payer{i}/tier", json={"tier": "pro"}, headers=root)
            free = await signup(c, "freeuser")
            done: list[str] = []

            async def call(headers, label):
                r = await c.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
                done.append(label)

            flood = [asyncio.create_task(call(payers[i % 4], f"pro{i}")) for i in range(24)]
            await asyncio.sleep(0.05)  # the flood is queued first
            free_task = asyncio.create_task(call(free, "free"))
            await asyncio.gather(*flood, free_task)
    assert backend.max_running == 1
    assert done.index("free") < 16, done  # served while most of the paid flood still waits


async def test_queue_timeout_is_a_503_and_costs_no_model_work(tmp_path):
    backend = ScriptedBackend(["a"] * 50, delay_s=0.02)
    app = traffic_app(tmp_path, backend, traffic={"admission_max_running": 1, "queue_max_wait_s": 0.2})
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as c:
            alice = await signup(c, "alice")
            bob = await signup(c, "bob")
            long = {"model": "scripted", "messages": [{"role": "user", "content": "long"}], "max_tokens": 50}
            busy = asyncio.create_task(c.post("/v1/chat/completions", json=long, headers=alice))
            while not backend.requests:  # alice's answer holds the one slot before bob asks
                await asyncio.sleep(0.005)
            r = await c.post("/v1/chat/completions", json={**long, "max_tokens": 3}, headers=bob)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "queue_timeout" and int(r.headers["retry-after"]) >= 1
            assert len(backend.requests) == 1  # only the running one reached the model

            # Over SSE, the conversation stream shows the queue position, then a 503 error event.
            cid = await new_conversation(c, bob)
            r = await c.post(f"/conversations/{cid}/messages", headers=bob, json={"text": "hi", "max_tokens": 3})
            events = parse_sse(r.text)
            assert events[0].data == {"queue_position": 1}
            err = events[-1]
            assert err.event == "error" and err.data["error"]["status"] == 503
            assert err.data["error"]["code"] == "queue_timeout" and err.data["retry_after"] >= 1
            assert len(backend.requests) == 1
            conv = (await c.get(f"/conversations/{cid}", headers=bob)).json()
            assert conv["messages"][-1]["status"] == "error"
            usage = (await c.get("/usage", headers=bob)).json()
            assert usage["totals"]["total_tokens"] == 0
            # The quota reservation was given back.
            assert usage["remaining_tokens_this_minute"] == usage["limits"]["tokens_per_minute"]
            assert (await busy).status_code == 200


def test_the_local_backend_reports_room_from_its_kv_blocks(tiny_backend):
    stats = tiny_backend.stats()
    free_tokens = stats.kv_cache_free_blocks * stats.block_size
    assert tiny_backend.has_room(1) and tiny_backend.has_room(free_tokens)
    assert not tiny_backend.has_room(free_tokens + 1)


async def test_stopping_an_answer_that_waits_in_the_queue(tmp_path):
    backend = ScriptedBackend(["a"] * 40, delay_s=0.02)
    app = traffic_app(tmp_path, backend, traffic={"admission_max_running": 1, "queue_max_wait_s": 20})
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as c:
            alice = await signup(c, "alice")
            body = {"model": "scripted", "messages": [{"role": "user", "content": "long"}], "max_tokens": 40}
            busy = asyncio.create_task(c.post("/v1/chat/completions", json=body, headers=alice))
            admission = app.state.ctx.traffic.admission
            while not backend.requests:  # the busy answer holds the one slot
                await asyncio.sleep(0.01)
            cid = await new_conversation(c, alice)
            sending = asyncio.create_task(c.post(f"/conversations/{cid}/messages", headers=alice,
                                                 json={"text": "hi", "max_tokens": 3}))
            while admission.waiting == 0:  # the new answer waits in the queue
                await asyncio.sleep(0.01)
            r = await asyncio.wait_for(c.post(f"/conversations/{cid}/stop", headers=alice), 2)
            assert r.json()["stopped"] is True
            events = parse_sse((await sending).text)
            assert events[0].data == {"queue_position": 1} and events[-1].data["status"] == "stopped"
            assert len(backend.requests) == 1  # the stopped answer never reached the model
            assert app.state.ctx.traffic.admission.waiting == 0
            assert (await busy).status_code == 200


async def test_admin_stats_show_the_admission_queue(client, alice):
    stats = (await client.get("/admin/stats", headers=alice)).json()
    # max_running defaults to the engine's max_num_seqs (EngineConfig's default: the one place it is set).
    seqs = EngineConfig().max_num_seqs
    assert stats["admission"] == {"waiting": 0, "running": 0, "max_running": seqs, "reasoning_running": 0,
                                  "reasoning_slots": seqs // 2}
