"""The event logs, in memory and on Redis Streams (the same tests for both): numbered events, reading
from any point, waiting, closing, retention; and on Redis, a writer that lost its job cannot append."""
from __future__ import annotations

import asyncio
import uuid

import pytest

from chatloom.app.state.events import MemoryEventLogStore
from chatloom.app.state.redis_connection import RedisHub
from chatloom.app.state.redis_events import LogTakenOver, RedisEventLogStore
from chatloom.app.api.sse import frame

from backing_services import require_redis


@pytest.fixture(params=["memory", "redis"])
async def make_logs(request):
    """An event log store factory: in this process, or on Redis Streams (skipped without a server)."""
    if request.param == "memory":
        yield lambda retention_s=600.0: MemoryEventLogStore(retention_s)
        return
    hub = RedisHub(require_redis())
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    yield lambda retention_s=600.0: RedisEventLogStore(hub.commands, hub.blocking, prefix, retention_s)
    await hub.close()


async def collect(log, after=0):
    return [(e.id, e.data) async for e in log.read(after) if e is not None]


async def test_ids_increase_and_readers_can_start_anywhere(make_logs):
    store = make_logs()
    log = await store.create("g1")
    for i in range(3):
        assert await log.append({"token": str(i)}) == i + 1
    await log.close()
    assert await collect(log) == [(1, {"token": "0"}), (2, {"token": "1"}), (3, {"token": "2"})]
    assert await collect(log, after=2) == [(3, {"token": "2"})]
    assert await collect(log, after=3) == []
    with pytest.raises(RuntimeError):
        await log.append({"late": True})


async def test_readers_wait_for_new_events_and_end_at_close(make_logs):
    store = make_logs()
    log = await store.create("g")
    readers = [asyncio.create_task(collect(log)) for _ in range(2)]
    readers.append(asyncio.create_task(collect(await store.get("g"))))  # another handle: another gateway's
    await asyncio.sleep(0.05)
    await log.append({"a": 1})
    await asyncio.sleep(0)
    await log.append({"b": 2}, event="error")
    await log.close()
    for r in readers:
        assert await r == [(1, {"a": 1}), (2, {"b": 2})]
    assert [e.event async for e in log.read()] == [None, "error"]
    assert (await store.get("g")).closed


async def test_heartbeats_while_idle(make_logs):
    log = await make_logs().create("g")
    it = log.read(0, heartbeat_s=0.01)
    assert await it.__anext__() is None
    await log.append({"x": 1})
    assert (await it.__anext__()).data == {"x": 1}
    await log.close()
    with pytest.raises(StopAsyncIteration):
        await it.__anext__()


async def test_closed_logs_are_kept_for_the_retention_period(make_logs):
    # Long enough that a loaded machine still reads the log before it goes; then wait for it to go.
    store = make_logs(retention_s=1.0)
    log = await store.create("g")
    await store.set_pointer("conv", "g")
    await log.append({"x": 1})
    await log.close()
    await store.pointer_ended("conv", "g")
    assert (await store.get("g")).key == "g" and await store.pointer("conv") == "g"
    deadline = asyncio.get_running_loop().time() + 10
    while await store.get("g") is not None or await store.pointer("conv") is not None:
        assert asyncio.get_running_loop().time() < deadline, "the closed log outlived its retention"
        await asyncio.sleep(0.05)
    if isinstance(store, RedisEventLogStore):  # every key is gone, the pointer too (not only hidden)
        while await store.commands.keys(f"{store.prefix}:*"):
            assert asyncio.get_running_loop().time() < deadline, await store.commands.keys(f"{store.prefix}:*")
            await asyncio.sleep(0.05)


async def test_a_pointer_moved_to_a_newer_log_keeps_its_expiry():
    hub = RedisHub(require_redis())
    store = RedisEventLogStore(hub.commands, hub.blocking, f"test-{uuid.uuid4().hex[:8]}", retention_s=1.0)
    first = await store.create("a")
    await store.set_pointer("conv", "a")
    second = await store.create("b")
    await store.set_pointer("conv", "b")  # the next answer started before the first's log closed
    await first.close()
    await store.pointer_ended("conv", "a")
    assert await store.commands.pttl(store.pointer_key("conv")) > 3_600_000
    await second.close()
    await store.pointer_ended("conv", "b")
    assert 0 < await store.commands.pttl(store.pointer_key("conv")) <= 1000
    await hub.close()


async def test_a_writer_that_lost_its_job_cannot_append():
    hub = RedisHub(require_redis())
    store = RedisEventLogStore(hub.commands, hub.blocking, f"test-{uuid.uuid4().hex[:8]}")
    old = await store.create("g")
    await old.append({"token": "a"})
    new = await store.open_for_writing("g")  # another gateway takes the job over
    assert [e.data for e in await store.events("g")] == [{"token": "a"}]
    assert await new.append({"token": "b"}) == 2
    with pytest.raises(LogTakenOver):
        await old.append({"token": "stale"})
    await new.close()
    assert await store.open_for_writing("g") is None  # closed: nothing to continue
    assert await collect(await store.get("g")) == [(1, {"token": "a"}), (2, {"token": "b"})]
    await hub.close()


async def test_a_writer_that_lost_its_job_is_fenced_off_before_the_new_one_writes():
    """Between the new writer reading where the log ends and its first append, the old writer cannot
    add a piece (it would be missing from what the new writer continues), nor end the log."""
    hub = RedisHub(require_redis())
    store = RedisEventLogStore(hub.commands, hub.blocking, f"test-{uuid.uuid4().hex[:8]}")
    old = await store.create("g")
    await old.append({"token": "a"})
    new = await store.open_for_writing("g")
    with pytest.raises(LogTakenOver):
        await old.append({"token": "stale"})
    await old.close()  # ends nothing: the log is the new writer's
    assert (await store.get("g")).closed is False
    assert [e.data for e in await store.events("g")] == [{"token": "a"}]
    assert await new.append({"token": "b"}) == 2
    await new.close()
    assert await collect(await store.get("g")) == [(1, {"token": "a"}), (2, {"token": "b"})]
    with pytest.raises(RuntimeError, match="reading"):
        await (await store.get("g")).append({"token": "c"})
    await hub.close()


def test_sse_frames():
    assert frame({"token": "hé"}, 7) == 'id: 7\ndata: {"token": "hé"}\n\n'.encode()
    assert frame({"error": {}}, 2, "error") == b'id: 2\nevent: error\ndata: {"error": {}}\n\n'
    assert frame("two\nlines") == b"data: two\ndata: lines\n\n"
