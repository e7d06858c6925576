"""The batch class in the admission queue: below every interactive tier, within its share of the slots,
never timed out nor refused, and a running batch request gives way when an interactive one cannot start."""
from __future__ import annotations

import asyncio

from chatloom.app.traffic.admission import BATCH, AdmissionQueue
from chatloom.app.traffic.tiers import DEFAULT_TIERS

FREE, PRO = DEFAULT_TIERS["free"], DEFAULT_TIERS["pro"]


async def test_batch_goes_only_while_no_interactive_request_waits():
    q = AdmissionQueue(lambda tokens: True, max_running=1, max_wait_s=30, batch_share=1.0)
    held = [await q.admit(FREE, 1)]
    order: list[str] = []

    async def one(tier, kind, label):
        slot = await q.admit(tier, 1, kind)
        order.append(label)
        await asyncio.sleep(0)
        slot.release()

    tasks = [asyncio.create_task(one(PRO, BATCH, "batch"))]  # a pro user's batch: first in, still last out
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(one(FREE, "interactive", f"free{i}")) for i in range(3)]
    await asyncio.sleep(0)
    for slot in held:
        slot.release()
    await asyncio.gather(*tasks)
    assert order[-1] == "batch", order


async def test_batch_holds_at_most_its_share_and_never_times_out():
    q = AdmissionQueue(lambda tokens: True, max_running=4, max_wait_s=0.05, batch_share=0.5)
    assert q.batch_slots() == 2
    slots = [await q.admit(PRO, 1, BATCH) for _ in range(2)]
    third = asyncio.create_task(q.admit(PRO, 1, BATCH))
    await asyncio.sleep(0.2)  # well past max_wait_s: a batch request waits on
    assert not third.done() and q.running_of(BATCH) == 2
    interactive = await asyncio.wait_for(q.admit(FREE, 1), 1)  # the slots left stay free for this
    slots[0].release()
    slots.append(await asyncio.wait_for(third, 1))
    for slot in (*slots, interactive):
        slot.release()


async def test_a_running_batch_request_gives_way_to_a_waiting_interactive_one():
    room = {"free": 1}
    q = AdmissionQueue(lambda tokens: room["free"] > 0, max_running=8, max_wait_s=5, poll_s=0.005, batch_share=0.5)
    older, newer = await q.admit(PRO, 1, BATCH), await q.admit(PRO, 1, BATCH)
    asked: list[str] = []
    older.on_yield = lambda: asked.append("older")
    newer.on_yield = lambda: asked.append("newer")
    room["free"] = 0  # the batch requests fill the KV cache
    waiting = asyncio.create_task(q.admit(FREE, 10))
    await asyncio.sleep(0.05)
    assert asked == ["newer"] and not waiting.done()  # one at a time, the newest first
    newer.release()  # it stopped: its blocks are free again
    room["free"] = 1
    slot = await asyncio.wait_for(waiting, 1)
    assert asked == ["newer"]
    slot.release()
    older.release()


async def test_busy_slots_cap_batch_while_interactive_requests_run():
    q = AdmissionQueue(lambda tokens: True, max_running=8, max_wait_s=5, batch_share=0.5, batch_busy_slots=1)
    assert q.batch_slots() == 4  # nothing interactive: the share
    chat = await q.admit(FREE, 1)
    assert q.batch_slots() == 1
    first = await q.admit(PRO, 1, BATCH)
    second = asyncio.create_task(q.admit(PRO, 1, BATCH))
    await asyncio.sleep(0.05)
    assert not second.done()
    chat.release()  # the interactive request ended: the batch may use its share again
    more = await asyncio.wait_for(second, 1)
    for slot in (first, more):
        slot.release()


async def test_batch_work_waits_while_an_interactive_request_is_starting():
    room = {"free": 1}
    q = AdmissionQueue(lambda tokens: room["free"] > 0, max_running=4, max_wait_s=5, poll_s=0.005)
    await asyncio.wait_for(q.until_interactive_started(), 1)  # nothing interactive: at once
    batch = await q.admit(PRO, 1, BATCH)  # a batch request, even one with no output yet, holds nothing back
    await asyncio.wait_for(q.until_interactive_started(), 1)
    batch.started()
    room["free"] = 0
    admitted = asyncio.create_task(q.admit(FREE, 1))  # waits for room
    await asyncio.sleep(0)
    quiet = asyncio.create_task(q.until_interactive_started())
    await asyncio.sleep(0.02)
    assert not quiet.done() and not admitted.done()
    room["free"] = 1
    slot = await asyncio.wait_for(admitted, 1)
    await asyncio.sleep(0.02)
    assert not quiet.done()  # admitted, no output yet: still starting
    slot.started()  # its first output
    await asyncio.wait_for(quiet, 1)
    # Once it has started, a running interactive request holds nothing back; a batch request never does.
    await asyncio.wait_for(q.until_interactive_started(), 1)
    never_started = await q.admit(FREE, 1)
    gate = asyncio.create_task(q.until_interactive_started())
    await asyncio.sleep(0.02)
    assert not gate.done()
    never_started.release()  # ended before any output (an error, a client gone)
    await asyncio.wait_for(gate, 1)
    for s in (slot, batch):
        s.release()


async def test_the_backend_is_told_while_an_interactive_request_is_starting():
    told: list[bool] = []
    room = {"free": 1}
    q = AdmissionQueue(lambda tokens: room["free"] > 0, max_running=4, max_wait_s=5, poll_s=0.005)
    q.on_starting = told.append
    batch = await q.admit(PRO, 1, BATCH)  # batch work alone tells nothing
    batch.started()
    assert told == []
    slot = await q.admit(FREE, 1)
    assert told == [True]  # from its arrival in the queue
    second = await q.admit(FREE, 1)
    slot.started()
    assert told == [True]  # the second one is still starting
    second.started()
    assert told == [True, False]
    room["free"] = 0
    waiting = asyncio.create_task(q.admit(FREE, 1))  # waits for room: starting already
    await asyncio.sleep(0)
    assert told == [True, False, True]
    waiting.cancel()  # left the queue before it started
    await asyncio.gather(waiting, return_exceptions=True)
    assert told == [True, False, True, False]
    for s in (slot, second, batch):
        s.release()


async def test_batch_work_waits_for_the_users_first_output_not_the_engines():
    q = AdmissionQueue(lambda tokens: True, max_running=4, max_wait_s=5, poll_s=0.005)
    told: list[bool] = []
    q.on_starting = told.append
    slot = await q.admit(FREE, 1)
    slot.started(shown=False)  # the engine's first token, held back by the output check
    gate = asyncio.create_task(q.until_interactive_started())
    await asyncio.sleep(0.02)
    assert not gate.done() and told == [True]
    slot.shown()  # the first piece reached the user
    await asyncio.wait_for(gate, 1)
    assert told == [True, False]
    slot.release()
    assert told == [True, False]


async def test_a_gateway_that_stops_while_a_request_is_starting_lets_the_engine_go(tmp_path):
    """The engine may outlive the gateway (a local replica; the tests' shared engine): a gateway that stops
    while an interactive request is still starting must not leave the engine holding batch work, or every
    batch after it waits forever."""
    from chatloom.app.main import create_app

    from app_testing import make_settings
    from traffic_testing import ScriptedBackend

    class Recording(ScriptedBackend):
        def __init__(self) -> None:
            super().__init__()
            self.holds: list[bool] = []

        def hold_background(self, held: bool) -> None:
            self.holds.append(held)

    backend = Recording()
    app = create_app(make_settings(tmp_path), backend)
    async with app.router.lifespan_context(app):
        admission = app.state.ctx.traffic.admission
        slot = await admission.admit(FREE, 1)  # admitted; its user has no output yet when the gateway stops
        assert backend.holds == [True]
    assert backend.holds[-1] is False
    slot.release()
    assert backend.holds[-1] is False
