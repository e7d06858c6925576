"""Background loops stop when asked, even when a Redis call swallows the cancellation.

redis-py can turn the CancelledError that interrupts a command into a connection error; a loop that
retries on errors then went on, and a gateway shutting down waited for it forever.
"""
from __future__ import annotations

import asyncio

from chatloom.app.state.background import stop_loop
from chatloom.app.state.fleet_shares import FleetShares


class _GoneRedis:
    """Every command fails as a lost connection."""

    def __getattr__(self, name):
        async def fail(*args, **kwargs):
            raise ConnectionError("connection lost")
        return fail


async def _swallowing_sync() -> None:
    try:
        await asyncio.sleep(30)  # a command waiting on Redis
    except asyncio.CancelledError:
        raise ConnectionError("Connection closed by server.")  # what the client turned the cancel into


async def test_a_loop_whose_redis_call_swallows_the_cancel_still_stops():
    shares = FleetShares(_GoneRedis(), "g1", interval_s=0.05)
    shares.sync = _swallowing_sync
    await shares.start(max_running=4)
    await asyncio.sleep(0.05)  # inside the "command" now
    await asyncio.wait_for(shares.close(), timeout=5)
    assert shares._task.done()


async def test_stop_loop_cancels_again_until_the_task_ends():
    swallowed = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                swallowed.append(1)
                if len(swallowed) == 3:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_loop(task), timeout=5)
    assert task.cancelled() and len(swallowed) == 3


async def test_stop_loop_gives_up_on_a_task_that_never_ends(caplog):
    stubborn = [True]

    async def immortal() -> None:
        while True:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                if not stubborn[0]:
                    raise

    task = asyncio.create_task(immortal())
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_loop(task, timeout_s=0.3), timeout=5)
    assert not task.done() and "did not stop" in caplog.text
    stubborn[0] = False  # leave nothing running behind the test
    await stop_loop(task)
    assert task.cancelled()
