"""A draining gateway hands its running answers over: each answer stops writing here before its lease
is let go. In the other order a lease could lapse while the answer still wrote, and the gateway that
took it over would find those writes in its log and end the answer as failed."""
from __future__ import annotations

import asyncio

from chatloom.app.chat.stopping import Stopping


class _Run:
    def __init__(self, events: list[str], cid: str) -> None:
        self.events, self.cid = events, cid

    def stop(self) -> None:
        self.events.append(f"stop {self.cid}")


class _Log:
    async def settled(self) -> None:
        """Nothing is being published: the fake answers write their last piece themselves."""


class _Generation:
    def __init__(self, events: list[str], cid: str) -> None:
        self.run = _Run(events, cid)
        self.log = _Log()
        self.finished = asyncio.Event()
        self.abandoned = self.stop_requested = False
        self.task = None
        self.summary_ids = 0


class _Jobs:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def forget(self, cid: str) -> None:
        self.events.append(f"forget {cid}")


class _Gateway(Stopping):
    def __init__(self, events: list[str], cids: list[str]) -> None:
        self.jobs = _Jobs(events)
        self.draining = False
        self._running = {cid: _Generation(events, cid) for cid in cids}
        self.events = events

    async def finish_later(self) -> None:
        """Each answer's last write lands a moment after it was asked to stop."""
        while True:
            await asyncio.sleep(0.01)
            for cid, gen in list(self._running.items()):
                if gen.stop_requested and not gen.finished.is_set():
                    self.events.append(f"last write {cid}")
                    gen.finished.set()


async def test_answers_stop_writing_before_their_leases_are_let_go():
    events: list[str] = []
    gateway = _Gateway(events, ["c1", "c2"])
    writer = asyncio.create_task(gateway.finish_later())
    try:
        await gateway.shutdown(grace_s=0.0, hand_over=True)
    finally:
        writer.cancel()
    assert gateway.draining
    for cid in ("c1", "c2"):
        assert all(gen.abandoned for gen in gateway._running.values())
        assert events.index(f"last write {cid}") < events.index(f"forget {cid}"), events
