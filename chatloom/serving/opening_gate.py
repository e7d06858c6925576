"""A few new requests at a time through the router's placement, so that a burst of them cannot hold up
the answers already streaming through the same event loop.

Placing a request (tokenizing its prompt at a replica, choosing a replica, opening its stream) is a
chain of short steps on the gateway's event loop. When a thousand requests arrive together, a
thousand such chains are ready at once; every token of a running answer then waits behind all of them
on each hop through the loop, and its trip through the gateway grows from about a millisecond to
hundreds. Letting only `limit` requests through at a time keeps that backlog a few steps long, and the
burst as a whole is placed no later: the chains that do run are not slowed by the others.

A place is given back when the request's stream is about to be sent, or after `hold_s` whatever it is
waiting for (a replica slow to tokenize keeps the others waiting no longer than that).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class OpeningGate:
    def __init__(self, limit: int, hold_s: float) -> None:
        if limit < 0:
            raise ValueError("limit must be 0 (no gate) or more")
        if hold_s <= 0:
            raise ValueError("hold_s must be positive")
        self.limit = limit
        self.hold_s = hold_s
        self._semaphore: asyncio.Semaphore | None = None  # made on the loop that first uses it
        self.inside = 0  # requests holding a place now

    async def enter(self) -> Callable[[], None]:
        """Wait for a place; the function that gives it back (once, however often it is called)."""
        if self.limit == 0:
            return _nothing
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.limit)
        semaphore = self._semaphore
        await semaphore.acquire()
        self.inside += 1
        held = True

        def leave() -> None:
            nonlocal held
            if held:
                held = False
                self.inside -= 1
                timer.cancel()
                semaphore.release()

        timer = asyncio.get_running_loop().call_later(self.hold_s, leave)
        return leave


def _nothing() -> None:
    return None
