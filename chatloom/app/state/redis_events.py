"""Generation event logs on Redis Streams, so a stream started on one gateway resumes on any other.

A log is two keys sharing its hash tag: the stream (`...:events`), whose entry ids are `0-1`,
`0-2`, ... so they are the SSE event ids themselves, and a small state key (`...:state`, "open" or
"closed") that says the log exists before its first event. Closing adds an end marker entry, so a
reader learns of the end in order with the events, and gives both keys the retention time.

One writer per log: append writes an explicit id, and Redis refuses an id at or below the last
one, so a writer that lost the job to another gateway (its lease lapsed) fails instead of
interleaving; `open_for_writing` lets the new writer continue the numbering.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import redis.asyncio as redis
from redis.exceptions import ResponseError

from chatloom.app.state.events import EventLog, EventLogStore, StreamEvent
from chatloom.app.state.redis_connection import UNAVAILABLE

T = TypeVar("T")

END = b"end"
# An open log of a gateway that died and whose job nobody took over still goes away after this long.
OPEN_TTL_S = 24 * 3600
POLL_S = 5.0  # longest single wait, so a reader notices a log that expired under it
# A running answer's writer and its readers ride out a Redis restart this long (retrying with backoff)
# before the writer fails the answer and a reader ends its stream (its client resumes by event id).
OUTAGE_S = 30.0
BACKOFF_S = (0.05, 1.0)


async def _through_outage(call: Callable[[bool], Awaitable[T]], outage_s: float) -> T:
    """call(retry) until it gets past Redis being out of reach, for at most `outage_s`."""
    deadline = time.monotonic() + outage_s
    pause, retry = BACKOFF_S[0], False
    while True:
        try:
            return await call(retry)
        except UNAVAILABLE:
            if time.monotonic() + pause > deadline:
                raise
        await asyncio.sleep(pause)
        pause, retry = min(pause * 2, BACKOFF_S[1]), True


def _event(entry_id: str, fields: dict) -> StreamEvent:
    """A stream entry (`0-N`, its fields as bytes) as the event it holds."""
    name, tokens = fields.get(b"e"), fields.get(b"n")
    return StreamEvent(int(entry_id.split("-")[1]), json.loads(fields[b"d"]), name.decode() if name else None,
                       int(tokens) if tokens is not None else None)


class LogTakenOver(RuntimeError):
    """Another writer appended to this log: this gateway no longer owns the job."""


class RedisEventLog(EventLog):
    def __init__(self, store: "RedisEventLogStore", key: str, next_id: int = 1, closed: bool = False) -> None:
        self.key = key
        self._store = store
        self._next = next_id
        self._closed = closed

    @property
    def stream(self) -> str:
        return self._store.stream_key(self.key)

    async def append(self, data: dict, event: str | None = None, answer_tokens: int | None = None) -> int:
        if self._closed:
            raise RuntimeError(f"event log {self.key} is closed")
        n = self._next
        fields = {"d": json.dumps(data, ensure_ascii=False)}
        if event:
            fields["e"] = event
        if answer_tokens is not None:
            fields["n"] = str(answer_tokens)

        async def add(retry: bool) -> None:
            try:
                await self._store.commands.xadd(self.stream, fields, id=f"0-{n}")
            except ResponseError as exc:
                # A retry may find its own entry: the first try reached Redis and only the reply was lost.
                if "equal or smaller" in str(exc) and not (retry and await self._holds(n, fields["d"])):
                    raise LogTakenOver(f"event log {self.key} has a newer writer") from None
                if "equal or smaller" not in str(exc):
                    raise
            if n == 1:
                await self._store.commands.expire(self.stream, OPEN_TTL_S)

        await _through_outage(add, self._store.outage_s)
        self._next = n + 1
        return n

    async def _holds(self, n: int, data: str) -> bool:
        found = await self._store.commands.xrange(self.stream, f"0-{n}", f"0-{n}")
        return bool(found) and found[0][1].get(b"d", b"").decode() == data

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        retention_ms = max(1, int(self._store.retention_s * 1000))

        async def end(retry: bool) -> None:
            try:
                async with self._store.commands.pipeline(transaction=True) as pipe:
                    pipe.xadd(self.stream, {"end": "1"}, id=f"0-{self._next}")
                    pipe.set(self._store.state_key(self.key), "closed", px=retention_ms)
                    pipe.pexpire(self.stream, retention_ms)
                    await pipe.execute()
            except ResponseError as exc:
                ended = await self._store.commands.xrange(self.stream, f"0-{self._next}", f"0-{self._next}")
                if not (retry and "equal or smaller" in str(exc) and ended and END in ended[0][1]):
                    raise

        await _through_outage(end, self._store.outage_s)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def next_id(self) -> int:
        return self._next

    async def read(self, after: int = 0, heartbeat_s: float | None = None) -> AsyncIterator[StreamEvent | None]:
        client = self._store.blocking
        last = f"0-{max(0, after)}"
        quiet_since = time.monotonic()
        lost_since: float | None = None
        pause = BACKOFF_S[0]
        while True:
            wait = POLL_S if heartbeat_s is None else min(POLL_S, max(0.01, heartbeat_s - (time.monotonic() - quiet_since)))
            try:
                reply = await client.xread({self.stream: last}, count=256, block=max(1, int(wait * 1000)))
                gone = not reply and not await self._store.commands.exists(self._store.state_key(self.key))
            except UNAVAILABLE:
                # Redis restarting: keep the client (heartbeats) and read on where we were once it is back.
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > self._store.outage_s:
                    return  # the stream ends without its end; the client resumes by event id later
                if heartbeat_s is not None and time.monotonic() - quiet_since >= heartbeat_s:
                    quiet_since = time.monotonic()
                    yield None
                await asyncio.sleep(pause)
                pause = min(pause * 2, BACKOFF_S[1])
                continue
            lost_since, pause = None, BACKOFF_S[0]
            if not reply:
                if gone:
                    return  # expired (or never existed): nothing more will come
                if heartbeat_s is not None and time.monotonic() - quiet_since >= heartbeat_s:
                    quiet_since = time.monotonic()
                    yield None
                continue
            for entry_id, fields in reply[0][1]:
                last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                if END in fields:
                    return
                yield _event(last, fields)
            quiet_since = time.monotonic()


class RedisEventLogStore(EventLogStore):
    """Event logs of every gateway in one Redis; a closed log lasts retention_s."""

    def __init__(self, commands: redis.Redis, blocking: redis.Redis, prefix: str = "chatloom",
                 retention_s: float = 600.0, outage_s: float = OUTAGE_S) -> None:
        self.commands = commands
        self.blocking = blocking
        self.prefix = prefix
        self.retention_s = retention_s
        self.outage_s = outage_s

    def stream_key(self, key: str) -> str:
        return f"{self.prefix}:log:{{{key}}}:events"

    def state_key(self, key: str) -> str:
        return f"{self.prefix}:log:{{{key}}}:state"

    def pointer_key(self, name: str) -> str:
        return f"{self.prefix}:logptr:{name}"

    async def create(self, key: str) -> EventLog:
        async with self.commands.pipeline(transaction=True) as pipe:
            pipe.delete(self.stream_key(key))  # a fresh log, even if the key was used before
            pipe.set(self.state_key(key), "open", ex=OPEN_TTL_S)
            await pipe.execute()
        return RedisEventLog(self, key)

    async def get(self, key: str) -> EventLog | None:
        state = await self.commands.get(self.state_key(key))
        if state is None:
            return None
        return RedisEventLog(self, key, closed=state == b"closed")

    async def open_for_writing(self, key: str) -> RedisEventLog | None:
        """An open log, to be continued by a gateway that took its job over (None: closed or gone)."""
        state = await self.commands.get(self.state_key(key))
        if state != b"open":
            return None
        last = await self.commands.xrevrange(self.stream_key(key), count=1)
        next_id = 1
        if last:
            entry_id = last[0][0].decode() if isinstance(last[0][0], bytes) else last[0][0]
            next_id = int(entry_id.split("-")[1]) + 1
        return RedisEventLog(self, key, next_id=next_id)

    async def events(self, key: str) -> list[StreamEvent]:
        """Everything logged so far (no waiting): what a takeover continues from."""
        out = []
        for entry_id, fields in await self.commands.xrange(self.stream_key(key)):
            if END in fields:
                break
            out.append(_event(entry_id.decode() if isinstance(entry_id, bytes) else entry_id, fields))
        return out

    async def set_pointer(self, name: str, key: str) -> None:
        await self.commands.set(self.pointer_key(name), key, ex=OPEN_TTL_S)

    async def pointer(self, name: str) -> str | None:
        key = await self.commands.get(self.pointer_key(name))
        if key is None:
            return None
        key = key.decode()
        return key if await self.commands.exists(self.state_key(key)) else None
