"""Redis loses a log's last entries (restarted without its data, or from an older snapshot) while its
answer still runs: the writer puts back what it wrote before its next append or its end, so a reader
resuming after the last event it saw gets every event after it, with no gap (before, the next append
went on at the writer's next id and a resumed stream jumped from, say, 18 to 22)."""
from __future__ import annotations

import uuid

import pytest

from chatloom.app.state.redis_connection import RedisHub
from chatloom.app.state.redis_events import RedisEventLog, RedisEventLogStore

from backing_services import require_redis


@pytest.fixture
async def store():
    hub = RedisHub(require_redis())
    yield RedisEventLogStore(hub.commands, hub.blocking, f"test-{uuid.uuid4().hex[:8]}")
    await hub.close()


async def collect(log, after=0):
    return [(e.id, e.data) async for e in log.read(after) if e is not None]


async def wipe(store: RedisEventLogStore, key: str) -> None:
    """What a restart without data does to one log: its stream, state and writer keys are gone."""
    await store.commands.delete(store.stream_key(key), store.state_key(key), store.writer_key(key))


async def keep_first(store: RedisEventLogStore, key: str, count: int) -> None:
    """What a restart from an older snapshot does: the stream holds only its first `count` entries."""
    entries = (await store.commands.xrange(store.stream_key(key)))[:count]
    await store.commands.delete(store.stream_key(key))
    for entry_id, fields in entries:
        await store.commands.xadd(store.stream_key(key), fields, id=entry_id)


def tokens(*values: str) -> list[tuple[int, dict]]:
    return [(i + 1, {"token": v}) for i, v in enumerate(values)]


async def test_a_wiped_log_is_put_back_whole_before_the_next_event(store):
    log = await store.create("g")
    for t in "abc":
        await log.append({"token": t})
    await wipe(store, "g")
    assert await store.get("g") is None  # gone: a resume would answer 404
    assert await log.append({"token": "d"}) == 4
    reopened = await store.get("g")
    assert reopened is not None and not reopened.closed
    await log.close()
    assert await collect(reopened, after=2) == tokens("a", "b", "c", "d")[2:]
    assert await collect(await store.get("g")) == tokens("a", "b", "c", "d")


async def test_a_log_cut_back_to_an_older_snapshot_gets_its_tail_back(store):
    log = await store.create("g")
    for t in ["a", "b", "c", " 😀 ", "é\u2028\"}"]:
        await log.append({"token": t}, answer_tokens=1)
    await keep_first(store, "g", 3)
    assert await log.append({"token": "f"}) == 6
    await log.close()
    events = [e async for e in (await store.get("g")).read(0) if e is not None]
    assert [(e.id, e.data) for e in events] == tokens("a", "b", "c", " 😀 ", "é\u2028\"}", "f")
    assert [e.answer_tokens for e in events] == [1, 1, 1, 1, 1, None]  # the entries' other fields came back too


async def test_the_end_of_a_wiped_log_comes_after_everything_it_carried(store):
    log = await store.create("g")
    for t in "ab":
        await log.append({"token": t})
    await wipe(store, "g")
    await log.close()
    ended = await store.get("g")
    assert ended is not None and ended.closed
    assert await collect(ended) == tokens("a", "b")
    assert await store.open_for_writing("g") is None  # closed: nobody continues it


async def test_a_writer_that_took_the_job_over_puts_back_what_it_found(store):
    first = await store.create("g")
    for t in "abc":
        await first.append({"token": t})
    second = await store.open_for_writing("g")  # another gateway took the answer over
    await wipe(store, "g")
    assert await second.append({"token": "d"}) == 4
    await second.close()
    assert await collect(await store.get("g")) == tokens(*"abcd")


async def test_entries_the_writer_never_had_leave_a_gap_and_the_answer_goes_on(store):
    first = await store.create("g")
    for t in "abc":
        await first.append({"token": t})
    token = uuid.uuid4().hex
    await store.commands.set(store.writer_key("g"), token)
    # A writer that knows where the log ends but none of its entries, then the log is cut back.
    blind = RedisEventLog(store, "g", next_id=4, writer=token)
    await keep_first(store, "g", 1)
    assert await blind.append({"token": "d"}) == 4
    await blind.close()
    assert await collect(await store.get("g")) == [(1, {"token": "a"}), (4, {"token": "d"})]


async def test_an_intact_log_is_written_as_before(store):
    log = await store.create("g")
    for t in "abc":
        await log.append({"token": t})
    other = await store.create("h")  # another log's keys are untouched by this one's checks
    await other.append({"token": "x"})
    await log.close()
    assert await collect(await store.get("g")) == tokens(*"abc")
    assert [e.data for e in await store.events("h")] == [{"token": "x"}]
