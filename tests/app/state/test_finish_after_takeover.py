"""A gateway whose answer was taken over while it still ran (its lease lapsed, as when Redis restarts
without its data) must not save, settle or meter it when its own run ends: the gateway that took the
job over does. Before, both metered the answer, and the user was billed for it twice."""
from __future__ import annotations

import asyncio

from sqlalchemy import func, select

from chatloom.app.main import create_app
from chatloom.app.state.jobs import JobRecord
from chatloom.store import Message
from chatloom.store.models import DailyUsage as UsageRow

import httpx
from app_testing import RecordingBackend, new_conversation, signup


class GatedBackend(RecordingBackend):
    """Holds every answer back until `go` is set."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.go = asyncio.Event()

    async def _gated(self, request):
        await self.go.wait()
        async for delta in self.inner.stream(request):
            yield delta

    def stream(self, request):
        self.requests.append(request)
        return self._gated(request)


async def test_an_answer_taken_over_while_running_is_neither_saved_nor_metered_here(settings, tiny_backend):
    backend = GatedBackend(tiny_backend)
    app = create_app(settings, backend)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            alice = await signup(client, "alice")
            ctx = app.state.ctx
            cid = await new_conversation(client, alice)
            post = asyncio.create_task(client.post(f"/conversations/{cid}/messages", headers=alice,
                                                   json={"text": "hello", "max_tokens": 4}))
            jobs = ctx.hot.jobs
            while (record := await jobs.holder(cid)) is None or record.message_id is None or not backend.requests:
                await asyncio.sleep(0.01)
            # Another gateway takes the job over, as after a lapsed lease.
            jobs._jobs[cid] = JobRecord(cid, "another-gateway", message_id=record.message_id, spec=record.spec)
            backend.go.set()
            while cid in ctx.conversations._running:
                await asyncio.sleep(0.01)
            post.cancel()
            async with ctx.db.session() as session:
                metered = await session.scalar(select(func.count()).select_from(UsageRow))
                saved = await session.get(Message, record.message_id)
            assert metered == 0
            assert saved.status == "incomplete" and saved.finish_reason is None
