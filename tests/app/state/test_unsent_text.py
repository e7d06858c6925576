"""A writer that journaled a batch of text and died (or was fenced off) before publishing it leaves the
saved answer longer than its log. Whoever ends that log sends the missing end first, so every reader
ends with the text that is stored (the chaos run's "resumed streams exact" found answers whose done
came after a log short of the saved text)."""
from __future__ import annotations

import uuid

from chatloom.app.state.hot_state import HotState
from chatloom.app.state.jobs import JobRecord, MemoryJobs
from chatloom.app.traffic.quotas import MemoryQuotaStore
from chatloom.app.state.redis_connection import RedisHub
from chatloom.app.state.redis_events import RedisEventLogStore
from chatloom.app.state.stop_relay import StopRelay
from chatloom.store import Message

from backing_services import require_redis


async def _ended_elsewhere(logged: list[str], saved: str) -> list[dict]:
    hub = RedisHub(require_redis())
    logs = RedisEventLogStore(hub.commands, hub.blocking, f"test-{uuid.uuid4().hex[:8]}")
    hot = HotState("g2", MemoryQuotaStore(), logs, MemoryJobs("g2"), StopRelay())
    try:
        writer = await logs.create("m1")  # the first gateway's log, left open when it died
        for piece in logged:
            await writer.append({"token": piece})
        message = Message(id="m1", conversation_id="c1", parent_id="u1", text=saved, status="interrupted",
                          finish_reason=None, prompt_tokens=7, completion_tokens=5, tokens=5)
        await hot._end_open_log(JobRecord("c1", "g1", message_id="m1", spec={}), message)
        return [e.data async for e in (await logs.get("m1")).read(0) if e is not None]
    finally:
        await hub.close()


async def test_the_saved_text_the_log_never_carried_is_sent_before_the_end():
    events = await _ended_elsewhere(["Hello", " there"], "Hello there, friend")
    assert [e.get("token") for e in events[:-1]] == ["Hello", " there", ", friend"]
    assert events[-1]["done"] and events[-1]["status"] == "interrupted"
    assert "".join(e.get("token", "") for e in events) == "Hello there, friend"


async def test_a_log_that_holds_all_of_it_or_another_text_gets_only_the_end():
    for logged, saved in ((["Hello", " there"], "Hello there"), (["Hello"], "Goodbye")):
        events = await _ended_elsewhere(logged, saved)
        assert [e.get("token") for e in events[:-1]] == logged and events[-1]["done"]
