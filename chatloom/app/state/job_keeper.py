"""Keeps this gateway's job leases alive and picks up the jobs of gateways that died.

Every `lease_s / 3` the keeper renews the leases of the answers running here, then looks for jobs
whose lease lapsed (their gateway stopped renewing: killed, frozen, cut off) and takes them, one
gateway per job (RedisJobs.take is atomic). A taken job is handed to `resume` (continue the answer
from the tokens it logged, see conversation_service); if it cannot be continued, the answer is
saved as failed with the reason and its stream ends with an error event, never left 'incomplete'.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from chatloom.app.state.background import cancel_requested, stop_loop
from chatloom.app.state.jobs import JobRecord, Jobs
from chatloom.app.traffic.quotas import QuotaStore, Reservation

log = logging.getLogger(__name__)

Resume = Callable[[JobRecord], Awaitable[bool]]  # True: the answer goes on here
Fail = Callable[[JobRecord, str], Awaitable[None]]


class JobKeeper:
    def __init__(self, jobs: Jobs, resume: Resume, fail: Fail, on_lost: Callable[[str], Awaitable[object]],
                 accepting: Callable[[], bool] = lambda: True) -> None:
        self.jobs = jobs
        self.accepting = accepting  # False while this gateway shuts down or its model loads: it takes no jobs
        self.resume = resume
        self.fail = fail
        self.on_lost = on_lost  # a lease this gateway lost (another took the job): stop its copy here
        self._task: asyncio.Task | None = None
        self._taking: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="job-keeper")

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: leases may lapse; try again
                if cancel_requested():
                    raise asyncio.CancelledError from exc
                log.warning("job leases not renewed: %s", exc)
            await asyncio.sleep(self.jobs.lease_s / 3)

    async def tick(self) -> None:
        for cid in await self.jobs.renew():
            log.warning("lost the lease of conversation %s's answer to another gateway; stopping it here", cid)
            task = asyncio.create_task(self.on_lost(cid))
            self._taking.add(task)
            task.add_done_callback(self._taking.discard)
        if not self.accepting():
            return
        for record in await self.jobs.lapsed():
            taken = await self.jobs.take(record.conversation_id)
            if taken is None:
                continue
            log.warning("taking over answer %s of conversation %s from gateway %s", taken.message_id,
                        taken.conversation_id, record.gateway)
            task = asyncio.create_task(self._take_over(taken), name=f"takeover-{taken.conversation_id}")
            self._taking.add(task)
            task.add_done_callback(self._taking.discard)

    async def _take_over(self, record: JobRecord) -> None:
        try:
            if record.message_id is not None and await self.resume(record):
                return
            reason = "its gateway stopped before the answer started" if record.message_id is None else \
                "its gateway stopped and the answer could not be continued"
        except Exception as exc:
            log.exception("taking over answer %s failed", record.message_id)
            reason = f"its gateway stopped and continuing the answer failed: {exc}"
        try:
            await self.fail(record, reason)
        finally:
            await self.jobs.release(record.conversation_id)

    async def close(self) -> None:
        await stop_loop(self._task)
        for task in list(self._taking):
            task.cancel()
        await asyncio.gather(*self._taking, return_exceptions=True)


def reservation_of(spec: dict) -> Reservation | None:
    """The quota reservation a job record carries (so whoever ends the job settles it)."""
    r = spec.get("reservation")
    if not r:
        return None
    return Reservation(r["user_id"], r["tokens"], r["created"], r["day"], id=r["id"])


def reservation_spec(reservation: Reservation | None) -> dict | None:
    if reservation is None:
        return None
    return {"id": reservation.id, "user_id": reservation.user_id, "tokens": reservation.tokens,
            "created": reservation.created, "day": reservation.day}


async def settle_taken(quotas: QuotaStore, spec: dict, used: int | None = None) -> None:
    reservation = reservation_of(spec)
    if reservation is not None:
        await quotas.settle(reservation, reservation.tokens if used is None else used)
