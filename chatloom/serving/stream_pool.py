"""HTTP clients for the requests on an answer's path to one server, a bounded number open on each.

httpcore's connection pool looks at every connection it holds each time a request starts or a response
closes. A gateway with a thousand answers streaming from one replica would hold a thousand connections
in one pool, and every new stream and every ending one would walk all of them: milliseconds of the
event loop per stream set up, while the other streams' tokens wait behind it. Spread over clients of
at most `per_client` open requests each, a start or an end walks at most that many connections.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx


class StreamClients:
    """Clients made by `make_client` on demand; a request takes the first one with room."""

    def __init__(self, make_client: Callable[[int], httpx.AsyncClient], per_client: int = 32) -> None:
        if per_client < 1:
            raise ValueError("per_client must be at least 1")
        self._make_client = make_client
        self.per_client = per_client
        self._clients: list[httpx.AsyncClient] = []
        self._open: list[int] = []  # streams open on each client, by index

    @property
    def clients(self) -> int:
        return len(self._clients)

    @property
    def open_streams(self) -> int:
        return sum(self._open)

    def _take(self) -> int:
        for i, n in enumerate(self._open):
            if n < self.per_client:
                self._open[i] += 1
                return i
        self._clients.append(self._make_client(self.per_client))
        self._open.append(1)
        return len(self._clients) - 1

    async def request(self, method: str, path: str, **kw) -> httpx.Response:
        """`client.request(method, path, **kw)`, the body read, on a client with room for it."""
        i = self._take()
        try:
            return await self._clients[i].request(method, path, **kw)
        finally:
            self._open[i] -= 1

    @asynccontextmanager
    async def stream(self, method: str, path: str, **kw) -> AsyncIterator[httpx.Response]:
        """`client.stream(method, path, **kw)` on a client with room for one more stream."""
        i = self._take()
        try:
            async with self._clients[i].stream(method, path, **kw) as response:
                yield response
        finally:
            self._open[i] -= 1

    async def aclose(self) -> None:
        clients, self._clients, self._open = self._clients, [], []
        for client in clients:
            await client.aclose()
