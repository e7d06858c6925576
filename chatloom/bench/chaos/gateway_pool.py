"""The chaos traffic's HTTP/2 clients: one per gateway, replaced when its connection breaks.

A draining Hypercorn gateway answers a new stream with RST_STREAM and SETTINGS_MAX_CONCURRENT_STREAMS=0
before its GOAWAY; a killed one just closes its sockets. httpcore 1.0 ignores a zero stream limit, so h2
then refuses every new stream on that connection ("Max outbound streams is 0") before anything is read:
the connection never learns that the server went away, and each failed request renews its keep-alive,
so the pool keeps it for good and every later request on that client fails at once. A long-lived client
therefore cannot be trusted after a failure on an established connection: such a failure gives the
gateway a new client, and the old one is closed as soon as the requests still using it are done (they
are on the same broken connection, so that is soon), which leaves no connection open behind it.

A refused or timed-out connect (a gateway being restarted), a slow read and a 4xx/5xx reply say nothing
about the pooled connection and keep the client.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

TIMEOUT = httpx.Timeout(connect=5.0, read=90.0, write=30.0, pool=30.0)
# Failures of a request on an established (or pooled) connection: the connection is broken or draining.
BREAKS_CONNECTION = (httpx.ProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError, httpx.PoolTimeout)
# Failures after which the gateway cannot have seen the request (nothing was sent).
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.LocalProtocolError)


def new_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, http2=True, verify=False, timeout=TIMEOUT,
                             limits=httpx.Limits(max_connections=50, max_keepalive_connections=20))


@dataclass(eq=False)
class _Held:
    client: httpx.AsyncClient
    users: int = 0
    retired: bool = False


class GatewayClients:
    """`async with clients.use(name) as client:` for every request; see the module's docstring."""

    def __init__(self, urls: dict[str, str], factory: Callable[[str], httpx.AsyncClient] = new_client) -> None:
        self.urls = dict(urls)
        self._factory = factory
        self._current = {name: _Held(factory(url)) for name, url in self.urls.items()}
        self._retired: set[_Held] = set()
        self.renewals = {name: 0 for name in self.urls}

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[httpx.AsyncClient]:
        held = self._current[name]
        held.users += 1
        try:
            yield held.client
        except BREAKS_CONNECTION:
            self._renew(name, held)
            raise
        finally:
            held.users -= 1
            if held.retired and held.users == 0 and held in self._retired:
                await held.client.aclose()
                self._retired.discard(held)  # after: a close cut short is left to aclose()

    def _renew(self, name: str, held: _Held) -> None:
        if self._current[name] is not held:
            return  # another request on the same broken client renewed it already
        self._current[name] = _Held(self._factory(self.urls[name]))
        self.renewals[name] += 1
        held.retired = True
        self._retired.add(held)

    async def aclose(self) -> None:
        for held in [*self._current.values(), *self._retired]:
            await held.client.aclose()
        self._retired.clear()
