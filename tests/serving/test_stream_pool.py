"""Answer streams spread over clients with small connection pools."""
from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from chatloom.serving.stream_pool import StreamClients


def _pool(per_client: int) -> tuple[StreamClients, list[httpx.AsyncClient]]:
    made: list[httpx.AsyncClient] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/fail":
            return httpx.Response(500, text="no")
        return httpx.Response(200, text=f"data: {request.url.path}\n\n")

    def make(keepalive: int) -> httpx.AsyncClient:
        client = httpx.AsyncClient(base_url="http://replica", transport=httpx.MockTransport(answer),
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=keepalive))
        made.append(client)
        return client

    return StreamClients(make, per_client=per_client), made


async def test_streams_take_a_new_client_only_when_every_client_is_full():
    pool, made = _pool(per_client=4)
    async with contextlib.AsyncExitStack() as stack:
        responses = [await stack.enter_async_context(pool.stream("POST", f"/s{i}")) for i in range(9)]
        assert pool.clients == 3 and len(made) == 3 and pool.open_streams == 9
        assert [r.status_code for r in responses] == [200] * 9
        assert (await responses[8].aread()) == b"data: /s8\n\n"
    assert pool.open_streams == 0
    # Freed room is reused, the first client first; no client is made while one has room.
    async with pool.stream("POST", "/again") as r:
        assert r.request.url.path == "/again"
        assert pool.clients == 3
        # A one-shot request takes room too while it runs, and gives it back with its body read.
        answered = await pool.request("POST", "/tokenize")
        assert answered.text == "data: /tokenize\n\n" and pool.open_streams == 1
    await pool.aclose()
    assert pool.clients == 0 and all(c.is_closed for c in made)


async def test_a_stream_that_fails_gives_its_room_back():
    pool, _ = _pool(per_client=1)
    with pytest.raises(RuntimeError):
        async with pool.stream("POST", "/s"):
            raise RuntimeError("reader gave up")
    async with pool.stream("POST", "/fail") as r:
        assert r.status_code == 500
    assert pool.open_streams == 0 and pool.clients == 1
    await pool.aclose()


async def test_concurrent_streams_never_put_more_than_per_client_on_one_client():
    pool, made = _pool(per_client=8)
    peak: list[int] = []

    async def one(i: int) -> None:
        async with pool.stream("POST", f"/s{i}") as r:
            await r.aread()
            peak.append(max(pool._open))
            await asyncio.sleep(0)

    await asyncio.gather(*(one(i) for i in range(50)))
    assert max(peak) <= 8 and pool.open_streams == 0
    assert len(made) == pool.clients >= 50 // 8
    await pool.aclose()


def test_per_client_must_be_positive():
    with pytest.raises(ValueError, match="per_client"):
        StreamClients(lambda n: httpx.AsyncClient(), per_client=0)
