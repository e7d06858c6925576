"""Per-generation event logs: numbered events that SSE responses read, from any point.

A generation writes its events (tokens, the final 'done' or an error) to a log; every client
attached to it reads from the log, not from the generation. A disconnecting client therefore
loses nothing, and a client can resume after any event id. The log outlives the generation by
a retention period. The in-memory store serves one process; a Redis-backed store (streams with
XADD/XREAD) can implement the same two classes for several gateways.
"""
from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Callable


@dataclass(frozen=True)
class StreamEvent:
    id: int  # 1, 2, 3... within one log
    data: dict
    event: str | None = None  # the SSE event name; None is the default 'message'
    # The writer's count of answer tokens so far, kept beside the event (clients never see it): a
    # gateway that takes the answer over continues its budget from here, not from re-tokenizing the text.
    answer_tokens: int | None = None


class EventLog(abc.ABC):
    key: str

    @abc.abstractmethod
    async def append(self, data: dict, event: str | None = None, answer_tokens: int | None = None) -> int:
        """Add an event (with the answer's token count so far, when the writer knows it); returns its id."""

    @abc.abstractmethod
    async def close(self) -> None:
        """No more events will come; readers end after the last one."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @property
    @abc.abstractmethod
    def next_id(self) -> int:
        """The id the next appended event gets."""

    @abc.abstractmethod
    def read(self, after: int = 0, heartbeat_s: float | None = None) -> AsyncIterator[StreamEvent | None]:
        """Events with id > after, waiting for new ones until the log closes.
        Yields None when heartbeat_s passes with nothing new, so the caller can keep a connection alive."""


class EventLogStore(abc.ABC):
    @abc.abstractmethod
    async def create(self, key: str) -> EventLog: ...

    @abc.abstractmethod
    async def get(self, key: str) -> EventLog | None: ...

    # A named pointer to a log (a conversation's newest generation), so a client that knows only the
    # conversation can find the stream to resume. It lasts as long as the log it points to.
    @abc.abstractmethod
    async def set_pointer(self, name: str, key: str) -> None: ...

    @abc.abstractmethod
    async def pointer(self, name: str) -> str | None: ...

    async def pointer_ended(self, name: str, key: str) -> None:
        """The log `key` has closed: a pointer `name` still at it expires with it (here: with the log)."""


class MemoryEventLog(EventLog):
    def __init__(self, key: str, on_close: Callable[[MemoryEventLog], None] | None = None) -> None:
        self.key = key
        self._on_close = on_close
        self._events: list[StreamEvent] = []
        self._closed = False
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        # Wake every current reader, then give later waits a fresh event.
        self._changed.set()
        self._changed = asyncio.Event()

    async def append(self, data: dict, event: str | None = None, answer_tokens: int | None = None) -> int:
        if self._closed:
            raise RuntimeError(f"event log {self.key} is closed")
        item = StreamEvent(len(self._events) + 1, data, event, answer_tokens)
        self._events.append(item)
        self._notify()
        return item.id

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._notify()
            if self._on_close is not None:
                self._on_close(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def next_id(self) -> int:
        return len(self._events) + 1

    @property
    def events(self) -> list[StreamEvent]:
        return list(self._events)

    async def read(self, after: int = 0, heartbeat_s: float | None = None) -> AsyncIterator[StreamEvent | None]:
        position = max(0, after)  # ids are 1-based list positions
        while True:
            while position < len(self._events):
                yield self._events[position]
                position += 1
            if self._closed:
                return
            changed = self._changed
            try:
                async with asyncio.timeout(heartbeat_s):
                    await changed.wait()
            except asyncio.TimeoutError:
                yield None


class MemoryEventLogStore(EventLogStore):
    """Logs in this process's memory; a closed log is dropped retention_s after it closes."""

    def __init__(self, retention_s: float = 600.0) -> None:
        self.retention_s = retention_s
        self._logs: dict[str, MemoryEventLog] = {}
        self._pointers: dict[str, str] = {}

    async def create(self, key: str) -> EventLog:
        log = MemoryEventLog(key, on_close=self._schedule_eviction)
        self._logs[key] = log
        return log

    async def get(self, key: str) -> EventLog | None:
        return self._logs.get(key)

    def _schedule_eviction(self, log: MemoryEventLog) -> None:
        asyncio.get_running_loop().call_later(self.retention_s, self._evict, log)

    async def set_pointer(self, name: str, key: str) -> None:
        self._pointers[name] = key

    async def pointer(self, name: str) -> str | None:
        key = self._pointers.get(name)
        return key if key in self._logs else None

    def _evict(self, log: MemoryEventLog) -> None:
        if self._logs.get(log.key) is log:
            del self._logs[log.key]
            for name in [n for n, k in self._pointers.items() if k == log.key]:
                del self._pointers[name]

    def __len__(self) -> int:
        return len(self._logs)


def logged_text(events: list) -> str:
    """The answer text a log's events carry (what readers were shown)."""
    return "".join(e.data.get("token", "") for e in events if isinstance(e.data, dict))
