"""The in-memory event log: numbered events, reading from any point, waiting, closing, retention."""
from __future__ import annotations

import asyncio

import pytest

from chatloom.app.events import MemoryEventLogStore
from chatloom.app.sse import frame


async def collect(log, after=0):
    return [(e.id, e.data) async for e in log.read(after) if e is not None]


async def test_ids_increase_and_readers_can_start_anywhere():
    store = MemoryEventLogStore()
    log = await store.create("g1")
    for i in range(3):
        assert await log.append({"token": str(i)}) == i + 1
    await log.close()
    assert await collect(log) == [(1, {"token": "0"}), (2, {"token": "1"}), (3, {"token": "2"})]
    assert await collect(log, after=2) == [(3, {"token": "2"})]
    assert await collect(log, after=3) == []
    with pytest.raises(RuntimeError):
        await log.append({"late": True})


async def test_readers_wait_for_new_events_and_end_at_close():
    log = await MemoryEventLogStore().create("g")
    readers = [asyncio.create_task(collect(log)) for _ in range(2)]
    await asyncio.sleep(0)
    await log.append({"a": 1})
    await asyncio.sleep(0)
    await log.append({"b": 2}, event="error")
    await log.close()
    for r in readers:
        assert await r == [(1, {"a": 1}), (2, {"b": 2})]
    assert [e.event async for e in log.read()] == [None, "error"]


async def test_heartbeats_while_idle():
    log = await MemoryEventLogStore().create("g")
    it = log.read(0, heartbeat_s=0.01)
    assert await it.__anext__() is None
    await log.append({"x": 1})
    assert (await it.__anext__()).data == {"x": 1}
    await log.close()
    with pytest.raises(StopAsyncIteration):
        await it.__anext__()


async def test_closed_logs_are_kept_for_the_retention_period():
    store = MemoryEventLogStore(retention_s=0.05)
    log = await store.create("g")
    await log.close()
    assert await store.get("g") is log
    await asyncio.sleep(0.1)
    assert await store.get("g") is None and len(store) == 0


def test_sse_frames():
    assert frame({"token": "hé"}, 7) == 'id: 7\ndata: {"token": "hé"}\n\n'.encode()
    assert frame({"error": {}}, 2, "error") == b'id: 2\nevent: error\ndata: {"error": {}}\n\n'
    assert frame("two\nlines") == b"data: two\ndata: lines\n\n"
