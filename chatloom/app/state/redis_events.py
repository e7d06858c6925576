"""Generation event logs on Redis Streams, so a stream started on one gateway resumes on any other.

A log is three keys sharing its hash tag: the stream (`...:events`), whose entry ids are `0-1`,
`0-2`, ... so they are the SSE event ids themselves, a small state key (`...:state`, "open" or
"closed") that says the log exists before its first event, and the writer key (`...:writer`), the
token of the one process allowed to write. Closing adds an end marker entry, so a reader learns of
the end in order with the events, and gives the keys the retention time.

One writer per log. `open_for_writing` (a gateway taking the job over) puts its own token in the
writer key before it reads where the log ends, and every append and close checks the token in the
same script as its XADD: from that moment the writer that lost the job (its lease lapsed while it
still ran, as during a Redis restart) fails with LogTakenOver instead of squeezing in one more piece
between what the new writer read and its first append. Appends also write explicit ids, which Redis
refuses at or below the last one, so a writer that knows no token cannot interleave either.

A writer keeps what it wrote. Redis restarted without its data (or with a snapshot older than the
log's tail) loses the log's last entries, and appending the next one would leave a gap: a reader
resuming after the last event it saw would skip what was lost. So every append and close first
checks that the stream ends where the writer left it; where it ends earlier the writer puts the lost
entries back, with their ids, and the state and writer keys with them, before going on.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import redis.asyncio as redis
from redis.exceptions import ResponseError

from chatloom.app.state.events import EventLog, EventLogStore, StreamEvent
from chatloom.app.state.redis_connection import UNAVAILABLE

T = TypeVar("T")
log = logging.getLogger(__name__)

END = b"end"
# An open log of a gateway that died and whose job nobody took over still goes away after this long.
OPEN_TTL_S = 24 * 3600
POLL_S = 5.0  # longest single wait, so a reader notices a log that expired under it
# A running answer's writer and its readers ride out a Redis restart this long (retrying with backoff)
# before the writer fails the answer and a reader ends its stream (its client resumes by event id).
OUTAGE_S = 30.0
BACKOFF_S = (0.05, 1.0)
TAKEN = "TAKEN"  # the error a script answers when another writer holds the log

LOST = "LOST"  # the error a script answers when the stream ends before the entry preceding the new one
# Every write starts here: another writer's token fails it.
_FENCE = """
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return redis.error_reply('TAKEN another writer holds this log') end
"""
# The stream's (KEYS[1]) last entry's sequence number as `seq` (0: empty or gone).
_LAST_SEQ = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq = 0
if #last > 0 then seq = tonumber(string.sub(last[1][1], 3)) end
"""
# A stream that ends before entry N - 1 (ARGV[2] is 0-N) answers LOST with its last entry's sequence
# number (0: empty or gone).
_NO_GAP = _LAST_SEQ + """
local n = tonumber(string.sub(ARGV[2], 3))
if n > 1 and seq < n - 1 then return redis.error_reply('LOST ' .. seq) end
"""
# KEYS: stream, writer. ARGV: writer token, entry id, field, value, ...
_APPEND = """
return redis.call('XADD', KEYS[1], ARGV[2], unpack(ARGV, 3))
"""
APPEND = _FENCE + _NO_GAP + _APPEND
APPEND_OVER_GAP = _FENCE + _APPEND
# KEYS: stream, writer, state. ARGV: writer token, entry id of the end marker, retention in ms.
_CLOSE = """
redis.call('XADD', KEYS[1], ARGV[2], 'end', '1')
redis.call('SET', KEYS[3], 'closed', 'PX', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""
CLOSE = _FENCE + _NO_GAP + _CLOSE
CLOSE_OVER_GAP = _FENCE + _CLOSE
# KEYS: state, writer, stream. ARGV: the new writer's token, its time to live in s. Returns the last
# entry's id ("0" for none), or nothing when the log is closed or gone.
REOPEN = """
if redis.call('GET', KEYS[1]) ~= 'open' then return false end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
if #last == 0 then return '0' end
return last[1][1]
"""
# KEYS: stream, writer, state. ARGV: writer token, the state's time to live in s, then per lost entry
# its id and its fields as one JSON object. Puts back what a writer wrote and Redis lost.
RESTORE = _FENCE + _LAST_SEQ + """
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
redis.call('SET', KEYS[3], 'open', 'EX', ARGV[2])
for i = 3, #ARGV, 2 do
  if tonumber(string.sub(ARGV[i], 3)) > seq then
    local fields = {}
    for k, v in pairs(cjson.decode(ARGV[i + 1])) do fields[#fields + 1] = k; fields[#fields + 1] = v end
    redis.call('XADD', KEYS[1], ARGV[i], unpack(fields))
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""
# KEYS: a pointer. ARGV: the log key it should point at, the time to live in ms.
EXPIRE_POINTER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


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
    """One answer's log; `writer` is this process's token for it (None: read only)."""

    def __init__(self, store: "RedisEventLogStore", key: str, next_id: int = 1, closed: bool = False,
                 writer: str | None = None, written: dict[int, dict[str, str]] | None = None) -> None:
        self.key = key
        self._store = store
        self._next = next_id
        self._closed = closed
        self._writer = writer
        # Every entry of the log this writer knows (id -> fields), to put back what Redis loses.
        self._written: dict[int, dict[str, str]] = written or {}

    @property
    def stream(self) -> str:
        return self._store.stream_key(self.key)

    def _writing(self) -> str:
        if self._writer is None:
            raise RuntimeError(f"event log {self.key} was opened for reading")
        if self._closed:
            raise RuntimeError(f"event log {self.key} is closed")
        return self._writer

    async def append(self, data: dict, event: str | None = None, answer_tokens: int | None = None) -> int:
        writer = self._writing()
        n = self._next
        fields = {"d": json.dumps(data, ensure_ascii=False)}
        if event:
            fields["e"] = event
        if answer_tokens is not None:
            fields["n"] = str(answer_tokens)
        args = [writer, f"0-{n}", *(x for pair in fields.items() for x in pair)]

        async def add(retry: bool) -> None:
            keys = [self.stream, self._store.writer_key(self.key)]
            try:
                await self._checked(self._store.append_script, self._store.append_over_gap_script, keys, args)
            except ResponseError as exc:
                if str(exc).startswith(TAKEN):
                    raise LogTakenOver(f"event log {self.key} has a newer writer") from None
                # A retry may find its own entry: the first try reached Redis and only the reply was lost.
                if "equal or smaller" in str(exc) and not (retry and await self._holds(n, fields["d"])):
                    raise LogTakenOver(f"event log {self.key} has a newer writer") from None
                if "equal or smaller" not in str(exc):
                    raise
            if n == 1:
                await self._store.commands.expire(self.stream, OPEN_TTL_S)

        await _through_outage(add, self._store.outage_s)
        self._written[n] = fields
        self._next = n + 1
        return n

    async def _checked(self, script: Any, over_gap: Any, keys: list[str], args: list) -> None:
        """Run an append or close script; where the stream lost entries before this one, put them back
        first. Entries this writer never knew cannot be put back: the gap stays, and the write goes on."""
        try:
            await script(keys=keys, args=args)
            return
        except ResponseError as exc:
            if not str(exc).startswith(LOST):
                raise
        await self.put_back()
        try:
            await script(keys=keys, args=args)
        except ResponseError as exc:
            if not str(exc).startswith(LOST):
                raise
            log.warning("event log %s lost entries this writer never had: %s", self.key, exc)
            await over_gap(keys=keys, args=args)

    async def put_back(self) -> None:
        """Restore the log's state, this writer's token and the entries Redis lost after the stream's
        last one (all of them when the stream is gone)."""
        entries = [x for n in sorted(self._written)
                   for x in (f"0-{n}", json.dumps(self._written[n], ensure_ascii=False))]
        await self._store.restore_script(
            keys=[self.stream, self._store.writer_key(self.key), self._store.state_key(self.key)],
            args=[self._writer, OPEN_TTL_S, *entries])
        log.warning("event log %s: Redis lost entries; put back from the writer's copy", self.key)

    async def _holds(self, n: int, data: str) -> bool:
        found = await self._store.commands.xrange(self.stream, f"0-{n}", f"0-{n}")
        return bool(found) and found[0][1].get(b"d", b"").decode() == data

    async def close(self) -> None:
        """End the log; a writer that lost it to another leaves it open for that one to end."""
        if self._closed:
            return
        writer = self._writing()
        self._closed = True
        retention_ms = max(1, int(self._store.retention_s * 1000))
        keys = [self.stream, self._store.writer_key(self.key), self._store.state_key(self.key)]

        async def end(retry: bool) -> None:
            try:
                await self._checked(self._store.close_script, self._store.close_over_gap_script, keys,
                                    [writer, f"0-{self._next}", retention_ms])
            except ResponseError as exc:
                if str(exc).startswith(TAKEN):
                    return
                ended = await self._store.commands.xrange(self.stream, f"0-{self._next}", f"0-{self._next}")
                if not (retry and "equal or smaller" in str(exc) and ended and END in ended[0][1]):
                    raise

        await _through_outage(end, self._store.outage_s)
        self._written.clear()

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
        self.append_script = commands.register_script(APPEND)
        self.close_script = commands.register_script(CLOSE)
        self.append_over_gap_script = commands.register_script(APPEND_OVER_GAP)
        self.close_over_gap_script = commands.register_script(CLOSE_OVER_GAP)
        self.restore_script = commands.register_script(RESTORE)
        self.reopen_script = commands.register_script(REOPEN)
        self.expire_pointer_script = commands.register_script(EXPIRE_POINTER)

    def stream_key(self, key: str) -> str:
        return f"{self.prefix}:log:{{{key}}}:events"

    def state_key(self, key: str) -> str:
        return f"{self.prefix}:log:{{{key}}}:state"

    def writer_key(self, key: str) -> str:
        return f"{self.prefix}:log:{{{key}}}:writer"

    def pointer_key(self, name: str) -> str:
        return f"{self.prefix}:logptr:{name}"

    async def create(self, key: str) -> EventLog:
        writer = uuid.uuid4().hex
        async with self.commands.pipeline(transaction=True) as pipe:
            pipe.delete(self.stream_key(key))  # a fresh log, even if the key was used before
            pipe.set(self.state_key(key), "open", ex=OPEN_TTL_S)
            pipe.set(self.writer_key(key), writer, ex=OPEN_TTL_S)
            await pipe.execute()
        return RedisEventLog(self, key, writer=writer)

    async def get(self, key: str) -> EventLog | None:
        state = await self.commands.get(self.state_key(key))
        if state is None:
            return None
        return RedisEventLog(self, key, closed=state == b"closed")

    async def open_for_writing(self, key: str) -> RedisEventLog | None:
        """An open log, to be continued by a gateway that took its job over (None: closed or gone). Its
        previous writer can append nothing more once this returns, so what it reads next is the whole log."""
        writer = uuid.uuid4().hex
        last = await self.reopen_script(keys=[self.state_key(key), self.writer_key(key), self.stream_key(key)],
                                        args=[writer, OPEN_TTL_S])
        if last is None:
            return None
        last = last.decode() if isinstance(last, bytes) else str(last)
        next_id = int(last.split("-")[1]) + 1 if "-" in last else 1
        written = {int(entry_id.decode().split("-")[1]): {k.decode(): v.decode() for k, v in fields.items()}
                   for entry_id, fields in await self.commands.xrange(self.stream_key(key), "-", f"0-{next_id - 1}")}
        return RedisEventLog(self, key, next_id=next_id, writer=writer, written=written)

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

    async def pointer_ended(self, name: str, key: str) -> None:
        """Give a pointer still at the closed log `key` the log's retention (it was set for an open log's day)."""
        await self.expire_pointer_script(keys=[self.pointer_key(name)],
                                         args=[key, max(1, int(self.retention_s * 1000))])

    async def pointer(self, name: str) -> str | None:
        key = await self.commands.get(self.pointer_key(name))
        if key is None:
            return None
        key = key.decode()
        return key if await self.commands.exists(self.state_key(key)) else None
