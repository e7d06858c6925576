"""A gateway whose answer was taken over while it still ran (its lease lapsed, as when Redis restarts
without its data) must not save, settle or meter it when its own run ends: the gateway that took the
job over does. Before, both metered the answer, and the user was billed for it twice. The check of who
holds the job leaves a window before the save; the database's fence on the final save closes it."""
from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from sqlalchemy import func, select

from chatloom.app.chat.takeover import logged_answer_tokens
from chatloom.app.main import create_app
from chatloom.app.state.jobs import JobRecord
from chatloom.store import Message
from chatloom.store.models import DailyUsage as UsageRow

import httpx
from app_testing import RecordingBackend, new_conversation, parse_sse, signup
from backing_services import require_redis
from test_shared_state import gateways


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


async def test_two_gateways_ending_one_answer_save_and_meter_it_once(tmp_path, db_url, tiny_backend):
    """Gateway 1 checks that it still holds the answer's job; then, before it saves, its lease lapses and
    gateway 2 takes the answer over and ends it (saved, metered, its stream closed). Gateway 1 then
    reaches its save: the database finds another writer there and it writes nothing. Before the fence,
    both saved and metered the answer."""
    async with AsyncExitStack() as stack:
        g1, g2 = await gateways(stack, tmp_path, db_url, require_redis(), tiny_backend,
                                shared_state={"job_lease_s": 30.0})
        ctx1, ctx2 = g1._transport.app.state.ctx, g2._transport.app.state.ctx
        await ctx1.hot.keeper.close()  # gateway 1 renews nothing: only the test moves the job
        service1 = ctx1.conversations
        check = service1._taken_over
        raced = asyncio.Event()

        async def check_then_lose_the_job(gen) -> bool:
            taken = await check(gen)  # False: gateway 1 still holds the job here
            await gen.log.flush()
            jobs, cid = ctx1.hot.jobs, gen.conversation_id
            record = await jobs.holder(cid)  # the answer has used its whole budget: taken over, it ends at once
            record.spec["max_tokens"] = logged_answer_tokens(await ctx1.hot.logs.events(gen.message_id)) or 0
            await jobs.update(record)
            await ctx1.hot.hub.commands.delete(jobs._keys(cid)[1])  # the lease lapses
            await ctx2.hot.keeper.tick()
            for _ in range(1000):  # until gateway 2 has ended the answer and let the job go
                if await ctx2.hot.jobs.holder(cid) is None:
                    break
                await asyncio.sleep(0.01)
            raced.set()
            return taken

        service1._taken_over = check_then_lose_the_job
        alice = await signup(g1, "alice")
        cid = await new_conversation(g1, alice)
        r = await asyncio.wait_for(g1.post(f"/conversations/{cid}/messages", headers=alice,
                                           json={"text": "hello", "max_tokens": 4}), 60)
        await asyncio.wait_for(raced.wait(), 30)  # (the stream ends with gateway 2's 'done', maybe before)
        for _ in range(1000):
            if service1.running(cid) is None:
                break
            await asyncio.sleep(0.01)
        done = [e.data for e in parse_sse(r.text) if isinstance(e.data, dict) and e.data.get("done")]
        assert len(done) == 1, done  # the stream ended once, by gateway 2
        async with ctx2.db.session() as session:
            requests = await session.scalar(select(func.coalesce(func.sum(UsageRow.requests), 0)))
            saved = await session.get(Message, done[0]["message_id"])
        assert requests == 1  # metered once
        assert saved.writer == ctx2.hot.jobs.instance and saved.finish_reason == "length"
        logged = await ctx2.hot.logs.events(saved.id)
        assert [e.data.get("done") for e in logged if isinstance(e.data, dict)].count(True) == 1
