"""Background loops (Redis, database sweeps), and how to stop them for sure.

A cancellation can be lost inside a Redis call: redis-py may turn the CancelledError that interrupts
a command into a connection error, which a loop that retries on errors then swallows, so the loop
goes on and whoever waits for it to end waits forever (seen as a gateway that never shut down).
Loops ask `cancel_requested()` in their error branch, and closers use `stop_loop`, which cancels
again until the task has really ended.
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


def cancel_requested() -> bool:
    """Whether the running task has been asked to stop (even if the CancelledError was swallowed)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def stop_loop(task: asyncio.Task | None, timeout_s: float = 10.0) -> None:
    """Cancel `task` and wait until it has ended, cancelling again while it keeps running."""
    if task is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
        if not task.done() and loop.time() > deadline:
            log.warning("background task %s did not stop within %.0f s; leaving it", task.get_name(), timeout_s)
            return
    if not task.cancelled() and task.exception() is not None:
        log.debug("background task %s ended with %r", task.get_name(), task.exception())
