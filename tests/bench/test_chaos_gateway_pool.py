"""The chaos traffic's per-gateway clients: a connection that a draining or dead gateway left broken
is replaced, the old client closed once nothing uses it; a refused connect keeps the client."""
from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import pytest

from chatloom.bench.chaos.gateway_pool import GatewayClients


class DrainingH2Server:
    """A cleartext HTTP/2 server whose every connection answers one request, and with that answer sends
    SETTINGS_MAX_CONCURRENT_STREAMS=0, as Hypercorn does on a connection when it starts draining."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        answered = False
        try:
            while data := await reader.read(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived) and not answered:
                        answered = True
                        conn.send_headers(event.stream_id, [(":status", "200"), ("content-length", "2")])
                        conn.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0})
                        conn.send_data(event.stream_id, b"ok", end_stream=True)
                writer.write(conn.data_to_send())
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


def h2c_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=5.0)


async def test_a_drained_connection_gets_a_new_client_and_the_old_one_is_closed():
    server = DrainingH2Server()
    clients = GatewayClients({"g": await server.start()}, factory=h2c_client)
    try:
        async with clients.use("g") as first:
            assert (await first.get("/")).status_code == 200
        # The zero stream limit came with that answer: h2 refuses the next stream before sending it.
        with pytest.raises(httpx.LocalProtocolError):
            async with clients.use("g") as client:
                await client.get("/")
        # One shared httpx client would fail so for good: the pool keeps that connection.
        for renewed in (1, 2):  # a new client's connection answers (once, then it too is renewed)
            async with clients.use("g") as client:
                r = await client.get("/")
            assert r.status_code == 200
            assert first.is_closed and clients.renewals == {"g": renewed}
            with pytest.raises(httpx.LocalProtocolError):
                async with clients.use("g") as client:
                    await client.get("/")
        assert clients.renewals == {"g": 3} and server.connections == 3
    finally:
        await clients.aclose()
        await server.stop()


def _mock(outcomes: dict[str, Exception | None]):
    def factory(url: str) -> httpx.AsyncClient:
        async def handler(request: httpx.Request) -> httpx.Response:
            exc = outcomes.get(request.url.path)
            if exc is not None:
                raise exc
            if request.url.path == "/slow":
                await asyncio.sleep(0.2)
            return httpx.Response(200)
        return httpx.AsyncClient(base_url=url, transport=httpx.MockTransport(handler))
    return factory


async def test_the_old_client_stays_open_until_its_last_request_ends():
    clients = GatewayClients({"g": "http://gateway"},
                             factory=_mock({"/broken": httpx.RemoteProtocolError("Server disconnected")}))
    async with clients.use("g") as old:
        slow = asyncio.create_task(old.get("/slow"))
        with pytest.raises(httpx.RemoteProtocolError):
            async with clients.use("g") as same:
                assert same is old
                await same.get("/broken")
        assert clients.renewals == {"g": 1} and not old.is_closed
        assert (await slow).status_code == 200
    assert old.is_closed
    async with clients.use("g") as new:
        assert new is not old and (await new.get("/")).status_code == 200
    await clients.aclose()
    assert new.is_closed


async def test_a_refused_connect_or_a_reply_keeps_the_client():
    clients = GatewayClients({"g": "http://gateway"},
                             factory=_mock({"/down": httpx.ConnectError("All connection attempts failed")}))
    async with clients.use("g") as client:
        assert (await client.get("/")).status_code == 200
    with pytest.raises(httpx.ConnectError):
        async with clients.use("g") as same:
            await same.get("/down")
    assert same is client and clients.renewals == {"g": 0} and not client.is_closed
    await clients.aclose()
