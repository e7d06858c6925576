"""The gateway's hot state, built from the settings: in memory (one process) or in Redis (a fleet).

`build_hot_state` picks the stores by `redis_url`; `install` wires them into an app (quotas into
traffic control, the fleet view into the admission queue, 503s for a Redis out of reach);
`start`/`close` run the background tasks (stop listener, lease keeper, fleet-share sync).
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import select

from chatloom.app.core.errors import error_response
from chatloom.app.state.events import EventLogStore, MemoryEventLogStore, logged_text
from chatloom.app.state.fleet_shares import FleetShares
from chatloom.app.state.job_keeper import JobKeeper, settle_taken
from chatloom.app.state.jobs import JobRecord, Jobs, MemoryJobs, RedisJobs, new_instance_id
from chatloom.app.state.redis_connection import UNAVAILABLE, RedisHub, unavailable_message
from chatloom.app.state.redis_events import RedisEventLogStore
from chatloom.app.core.attempts import AttemptStore, MemoryAttempts
from chatloom.app.state.redis_attempts import RedisAttempts
from chatloom.app.state.redis_quotas import RedisQuotaStore
from chatloom.app.state.stop_relay import RedisStopRelay, StopRelay
from chatloom.app.traffic.quotas import MemoryQuotaStore, QuotaStore
from chatloom.settings import Settings
from chatloom.store import AnswerChunks, Conversations, Database, Message, Messages

log = logging.getLogger(__name__)


def default_gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class HotState:
    gateway: str
    quotas: QuotaStore
    logs: EventLogStore
    jobs: Jobs
    stops: StopRelay
    fleet: FleetShares | None = None
    attempts: AttemptStore = field(default_factory=MemoryAttempts)  # sign-in and sign-up attempts
    hub: RedisHub | None = None
    keeper: JobKeeper | None = None
    _started: list = field(default_factory=list)

    @property
    def shared(self) -> bool:
        return self.hub is not None

    async def check(self) -> dict:
        """For /readyz: {"status": "ok" | "unavailable" | "not configured", ...}."""
        if self.hub is None:
            return {"status": "not configured", "detail": "in-memory hot state (one gateway)"}
        try:
            await self.hub.ping()
        except Exception as exc:
            return {"status": "unavailable", "error": unavailable_message(self.hub.where, exc)}
        return {"status": "ok", "url": self.hub.where, "gateway": self.gateway}

    async def fail_job(self, record: JobRecord, reason: str, db: Database) -> None:
        """Save a taken-over answer that cannot be continued as failed (with its partial text and the
        reason), end its stream with an error event, and settle its quota reservation."""
        if record.message_id:
            async with db.session() as session:
                message = await session.get(Message, record.message_id)
            if message is None or message.status != "incomplete" or message.finish_reason is not None:
                # It ended (its gateway saved it but could not let the job go, or a sweep marked it
                # interrupted; an answer cut by max_tokens ends 'incomplete' with finish_reason 'length'),
                # or it was deleted: nothing to save, but its readers must not wait forever.
                await self._end_open_log(record, message)
                return
        logged = ""
        if isinstance(self.logs, RedisEventLogStore) and record.message_id:
            events = await self.logs.events(record.message_id)
            logged = logged_text(events)
        if record.message_id:
            async with db.session() as session:
                # The database holds at least what readers were sent (answer_journal.py), even when Redis
                # lost the log; the log is longer only for an answer of a gateway that journaled nothing.
                await AnswerChunks(session).fold([record.message_id])
                saved = await session.scalar(select(Message.text).where(Message.id == record.message_id)) or ""
                text = logged if len(logged) > len(saved) else saved
                if not await Messages(session).finish(record.message_id, in_progress=True, text=text, status="error",
                                                      error=reason):
                    return  # its first gateway saved it after all, and settles it: it closes its stream too
                await Conversations(session).touch(record.conversation_id)
                await session.commit()
            event_log = await self.logs.open_for_writing(record.message_id) \
                if isinstance(self.logs, RedisEventLogStore) else None
            if event_log is not None:
                await self._send_unsent_text(event_log, logged, text)
                await event_log.append({"error": {"message": f"generation failed: {reason}", "type": "server_error",
                                                  "code": "gateway_lost", "status": 500},
                                        "message_id": record.message_id}, event="error")
                await event_log.close()
                await self.logs.pointer_ended(record.conversation_id, record.message_id)
        await settle_taken(self.quotas, record.spec)

    async def _end_open_log(self, record: JobRecord, message: Message | None) -> None:
        """Close the log of an answer that ended elsewhere, with its saved outcome as the last event."""
        event_log = await self.logs.open_for_writing(record.message_id) \
            if isinstance(self.logs, RedisEventLogStore) else None
        if event_log is None:
            return  # closed already, as it should be
        if message is not None:
            logged = logged_text(await self.logs.events(record.message_id))
            await self._send_unsent_text(event_log, logged, message.text or "")
        if message is None:
            await event_log.append({"error": {"message": "the answer was deleted", "type": "invalid_request_error",
                                              "code": "not_found", "status": 404},
                                    "message_id": record.message_id}, event="error")
        else:
            await event_log.append({"done": True, "message_id": message.id, "user_message_id": message.parent_id,
                                    "conversation_id": message.conversation_id, "status": message.status,
                                    "finish_reason": message.finish_reason,
                                    "usage": {"prompt_tokens": message.prompt_tokens or 0, "completion_tokens":
                                              message.completion_tokens if message.completion_tokens is not None
                                              else message.tokens or 0}})
        await event_log.close()
        await self.logs.pointer_ended(record.conversation_id, record.message_id)

    @staticmethod
    async def _send_unsent_text(event_log, logged: str, saved: str) -> None:
        """Before the last event, the end of the saved text that the log (`logged`: its text) never
        carried: its writer journaled a batch (answer_journal.py) and died, or was fenced, before
        publishing it, and the save (or a sweep's fold) kept it. Readers then end with the stored text."""
        if len(saved) > len(logged) and saved.startswith(logged):
            await event_log.append({"token": saved[len(logged):]})

    async def close(self) -> None:
        for closer in reversed(self._started):
            try:
                await closer()
            except Exception:
                log.exception("closing hot state")
        self._started.clear()
        if self.hub is not None:
            await self.hub.close()


def build_hot_state(settings: Settings) -> HotState:
    gateway = settings.shared_state.gateway_id or default_gateway_id()
    instance = new_instance_id(gateway)
    if not settings.shared_state.redis_url:
        return HotState(gateway, MemoryQuotaStore(), MemoryEventLogStore(settings.chat.event_log_retention_s),
                        MemoryJobs(gateway, instance=instance), StopRelay())
    hub = RedisHub(settings.shared_state.redis_url)
    prefix = settings.shared_state.prefix
    return HotState(gateway=gateway, hub=hub,
                    quotas=RedisQuotaStore(hub.commands, prefix),
                    logs=RedisEventLogStore(hub.commands, hub.blocking, prefix, settings.chat.event_log_retention_s),
                    jobs=RedisJobs(hub.commands, gateway, prefix, settings.shared_state.job_lease_s, instance),
                    stops=RedisStopRelay(hub.commands, hub.blocking, prefix, on_back=hub.drop_idle),
                    fleet=FleetShares(hub.commands, gateway, prefix), attempts=RedisAttempts(hub.commands, prefix))


def install_redis_errors(app: FastAPI, hot: HotState) -> None:
    """A request that needs Redis while it is out of reach is a 503 naming it (and says when to retry)."""
    if hot.hub is None:
        return

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        return error_response(503, unavailable_message(hot.hub.where, exc), "redis_unavailable",
                              headers={"Retry-After": "1"}, path=request.url.path)

    for exc_type in UNAVAILABLE:
        app.add_exception_handler(exc_type, unavailable)


def _takes_jobs(conversations) -> bool:
    """Whether this gateway takes over other gateways' answers now: not while it shuts down, nor before
    its model can serve (a restarted gateway whose router is still starting would fail them)."""
    backend = getattr(conversations, "backend", None)
    return not getattr(conversations, "draining", False) and (backend is None or backend.ready)


async def start_hot_state(hot: HotState, conversations, db: Database, max_running: int) -> None:
    """Start the background tasks; none waits on Redis, so a gateway starts while Redis is away."""
    conversations.jobs = hot.jobs
    await hot.stops.start(conversations.stop)
    hot._started.append(hot.stops.close)
    if hot.fleet is not None:
        await hot.fleet.start(max_running)
        hot._started.append(hot.fleet.close)
    if hot.shared:
        resume = getattr(conversations, "resume_job", None)

        async def no_resume(_record: JobRecord) -> bool:
            return False

        async def fail(record: JobRecord, reason: str) -> None:
            await hot.fail_job(record, reason, db)

        hot.keeper = JobKeeper(hot.jobs, resume or no_resume, fail, getattr(conversations, "abandon", conversations.stop),
                               accepting=lambda: _takes_jobs(conversations))
        await hot.keeper.start()
        hot._started.append(hot.keeper.close)
