"""Stop an answer on whichever gateway runs it.

POST .../stop may reach any gateway. If this one runs the answer, it stops it itself; otherwise it
publishes the conversation id on a Redis channel that every gateway listens to, and the one running
the answer stops it. The caller then waits for the answer's event log to close (the answer is saved
as 'stopped' by then), as a local stop waits for the job to finish.

The listener reconnects by itself when Redis restarts; a stop published while a gateway is cut off
is lost for that gateway (the client may send it again).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import redis.asyncio as redis

from chatloom.app.state.background import cancel_requested, stop_loop
from chatloom.app.state.events import EventLogStore
from chatloom.app.state.jobs import Jobs

log = logging.getLogger(__name__)

LocalStop = Callable[[str], Awaitable[object]]  # conversation id -> the stopped generation, or None


class StopRelay:
    """Without Redis: stops are local only (one process)."""

    async def publish(self, conversation_id: str) -> None:
        pass

    async def start(self, local_stop: LocalStop) -> None:
        pass

    async def close(self) -> None:
        pass


class RedisStopRelay(StopRelay):
    def __init__(self, commands: redis.Redis, blocking: redis.Redis, prefix: str = "chatloom",
                 on_back: Callable[[], Awaitable[None]] | None = None) -> None:
        self.commands = commands
        self.blocking = blocking
        self.on_back = on_back  # run when Redis is back after the listener lost it
        self.channel = f"{prefix}:stop"
        self._task: asyncio.Task | None = None
        self.listening = asyncio.Event()  # set while subscribed (tests wait for it)

    async def publish(self, conversation_id: str) -> None:
        await self.commands.publish(self.channel, conversation_id)

    async def start(self, local_stop: LocalStop) -> None:
        self._task = asyncio.create_task(self._listen(local_stop), name="stop-relay")

    async def _listen(self, local_stop: LocalStop) -> None:
        lost_at: float | None = None  # when Redis went away: one line when it goes, one when it is back
        while True:
            try:
                async with self.blocking.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    self.listening.set()
                    if lost_at is not None:
                        log.warning("stop relay listening again after %.1f s without Redis", time.monotonic() - lost_at)
                        lost_at = None
                        if self.on_back is not None:
                            await self.on_back()
                    async for message in pubsub.listen():
                        if message.get("type") != "message":
                            continue
                        cid = message["data"].decode()
                        # Stopping waits for the answer to be saved: do it beside the listener.
                        asyncio.create_task(_quietly(local_stop(cid)), name=f"remote-stop-{cid}")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis gone: listen again once it is back
                self.listening.clear()
                if cancel_requested():
                    raise asyncio.CancelledError from exc
                if lost_at is None:
                    lost_at = time.monotonic()
                    log.warning("stop relay lost Redis (%s); resubscribing every 0.5 s", exc)
                else:
                    log.debug("stop relay still without Redis: %s", exc)
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        await stop_loop(self._task)


async def _quietly(awaitable: Awaitable[object]) -> None:
    try:
        await awaitable
    except Exception:
        log.exception("a relayed stop failed")


async def stop_anywhere(conversation_id: str, local_stop: LocalStop, jobs: Jobs, relay: StopRelay,
                        logs: EventLogStore, timeout_s: float = 10.0) -> str | None:
    """Stop the conversation's running answer wherever it runs; returns its message id (None: none ran)."""
    gen = await local_stop(conversation_id)
    if gen is not None:
        return gen.message_id
    job = await jobs.holder(conversation_id)
    for _ in range(40):  # claimed, but its answer is still being set up: wait for it to start (2 s at most)
        if job is None or job.message_id is not None:
            break
        await asyncio.sleep(0.05)
        job = await jobs.holder(conversation_id)
    if job is None or job.message_id is None:
        return None
    await relay.publish(conversation_id)
    event_log = await logs.get(job.message_id)
    if event_log is not None:
        async def until_closed() -> None:
            async for _ in event_log.read(0, heartbeat_s=1.0):
                pass
        try:
            async with asyncio.timeout(timeout_s):
                await until_closed()
        except asyncio.TimeoutError:
            log.warning("answer %s did not stop within %.0f s", job.message_id, timeout_s)
    return job.message_id
