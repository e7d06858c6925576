"""The HTTP client for the requests on an answer's path to one server: its /tokenize and its stream.

A gateway relays every token of every answer through here, so this is aiohttp, whose HTTP parser and
stream reader are written in C, where httpx parses each chunk with h11 in Python and opens a cancel
scope for each read. Reading 1,000 answers of 10 SSE events each from a local server took 46-56 us of
CPU per event with aiohttp against 142-146 us with httpx (200 answers of 100 events: 35 against 83 us).
Probes, embeddings and KV instructions stay on httpx in RemoteBackend: they are few.

One session (its connection pool) per event loop: a session belongs to the loop it was made on, and a
backend may outlive one loop (tests, the CLI's short runs).
"""
from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp

# aiohttp reads lines of up to twice its buffer (a chunk with many tokens' top logprobs is a few hundred KB).
READ_BUFFER_BYTES = 1 << 20


class AnswerHTTPError(Exception):
    """The request failed below HTTP: refused, reset, closed under the reader or timed out (`timed_out`)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass
class Answered:
    """A whole response: its status and its body parsed as JSON (None when it is not JSON)."""

    status: int
    body: object


class AnswerStream:
    """An open streaming response: its status, the lines of its body, and close() to abort it."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines, without their line ends."""
        try:
            async for line in self._response.content:
                yield line.rstrip(b"\r\n")
        except Exception as exc:
            raise _failure(exc) from None

    async def read_json(self) -> object:
        """The whole body as JSON (None when it is not JSON)."""
        try:
            return _parse(await self._response.read())
        except Exception as exc:
            raise _failure(exc) from None

    def close(self) -> None:
        """Close the connection under the reader (the server aborts the request)."""
        self._response.close()


class AnswerClient:
    """POSTs of JSON to one server, whole or streamed, on one connection pool per event loop."""

    def __init__(self, base_url: str, headers: dict[str, str], ssl_context: ssl.SSLContext,
                 connect_s: float, between_chunks_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = dict(headers)
        self._ssl = ssl_context
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=between_chunks_s)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _current(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            if self._session is not None and not self._session.closed:
                _abandon(self._session)
            self._session = aiohttp.ClientSession(
                headers=self._headers, timeout=self._timeout, read_bufsize=READ_BUFFER_BYTES, trust_env=True,
                connector=aiohttp.TCPConnector(limit=0, ssl=self._ssl))
            self._loop = loop
        return self._session

    async def post(self, path: str, body: dict) -> Answered:
        """POST `body` and read the whole answer."""
        try:
            async with self._current().post(self.base_url + path, json=body) as response:
                return Answered(response.status, _parse(await response.read()))
        except Exception as exc:
            raise _failure(exc) from None

    @asynccontextmanager
    async def stream(self, path: str, body: dict) -> AsyncIterator[AnswerStream]:
        """POST `body` and hold the answer open while the caller reads it; leaving closes it."""
        try:
            response = await self._current().post(self.base_url + path, json=body)
        except Exception as exc:
            raise _failure(exc) from None
        try:
            yield AnswerStream(response)
        finally:
            response.close()  # an answer read to its [DONE] may still owe the chunked body's end

    async def aclose(self) -> None:
        session, self._session, self._loop = self._session, None, None
        if session is not None and not session.closed:
            await session.close()


def _abandon(session: aiohttp.ClientSession) -> None:
    """Let go of a session made on another event loop. Closing it is a coroutine of that loop, which has
    most likely ended, and its sockets with it; a keep-alive connection it still held is left to the
    collector."""
    session.detach()


def _parse(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _failure(exc: BaseException) -> BaseException:
    """aiohttp's and asyncio's errors as AnswerHTTPError with a reason a log line can name; others as they are."""
    if isinstance(exc, AnswerHTTPError):
        return exc
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's connect and read timeouts are ones too
        return AnswerHTTPError("no answer in time", timed_out=True)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return AnswerHTTPError("connection refused or host unreachable")
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return AnswerHTTPError("the connection broke (server died?)")
    if isinstance(exc, aiohttp.ClientConnectionError):
        return AnswerHTTPError(f"the stream was closed ({type(exc).__name__})")
    if isinstance(exc, aiohttp.ClientError):
        return AnswerHTTPError(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, aiohttp.http_exceptions.LineTooLong):
        return AnswerHTTPError("a line too long to read")
    return exc
