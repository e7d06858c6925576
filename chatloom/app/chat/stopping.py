"""Stopping answers: one on request (POST .../stop), all of them when the gateway shuts down, or one
that another gateway has taken over (abandoned here unsaved)."""
from __future__ import annotations

import asyncio
import logging

from chatloom.app.chat.answer_job import Generation
from chatloom.app.state.jobs import Jobs
from chatloom.serving import Backend

log = logging.getLogger(__name__)


class Stopping:
    """Stopping, draining and abandoning answers (a mixin of ConversationService)."""

    # Set up by ConversationService.__init__.
    backend: Backend
    jobs: Jobs
    draining: bool
    _running: dict[str, Generation | None]

    async def stop(self, conversation_id: str, timeout: float = 10.0) -> Generation | None:
        """Abort the running answer (the engine frees its blocks at once) and wait until it is saved."""
        gen = self._running.get(conversation_id)
        if gen is None:
            return None
        gen.stop_requested = True
        gen.run.stop()
        if gen.summary_ids:  # a summary may be running under its own id
            self.backend.abort(f"{gen.message_id}-summary-{gen.summary_ids - 1}")
        try:
            async with asyncio.timeout(timeout):
                await gen.finished.wait()
                await gen.log.settled()  # a piece being published when it was discarded has landed or failed
        except asyncio.TimeoutError:
            log.warning("generation %s did not stop within %.0f s", gen.message_id, timeout)
        return gen

    async def shutdown(self, grace_s: float = 0.0, hand_over: bool = False) -> None:
        """Take no new answers; give the running ones `grace_s` to finish; then hand the rest over to
        the other gateways (hand_over: their leases lapse and another gateway continues them) or, alone,
        stop them (saved as 'stopped')."""
        self.draining = True
        running = [g for g in self._running.values() if g is not None]
        if running and grace_s > 0:
            await asyncio.wait([asyncio.ensure_future(g.finished.wait()) for g in running], timeout=grace_s)
        left = [cid for cid, g in list(self._running.items()) if g is not None]
        if not hand_over:
            await asyncio.gather(*(self.stop(cid) for cid in left))
            return
        for cid in left:
            log.warning("handing the answer of conversation %s over to another gateway", cid)
        # Stop writing first, then stop renewing the leases: a lease that lapsed while an answer still
        # wrote here would let another gateway take it over and then find this one's writes in its log
        # (it would end the answer as failed).
        await asyncio.gather(*(self.abandon(cid) for cid in left))
        forget = getattr(self.jobs, "forget", None)
        if forget is not None:
            for cid in left:
                forget(cid)  # the lease lapses and another gateway takes the job

    async def abandon(self, conversation_id: str, timeout: float = 5.0) -> None:
        """End the answer here without saving it: another gateway has it (or will take it over)."""
        gen = self._running.get(conversation_id)
        if gen is None:
            return
        gen.abandoned = gen.stop_requested = True
        gen.run.stop()
        try:
            async with asyncio.timeout(timeout):
                await gen.finished.wait()
                await gen.log.settled()  # a piece being published when it was discarded has landed or failed
        except asyncio.TimeoutError:
            if gen.task is not None:
                gen.task.cancel()
