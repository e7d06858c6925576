"""The stop relay while Redis is away: one line when it goes, one when it is back, not one every retry."""
from __future__ import annotations

import asyncio
import logging
import os

import redis.asyncio as redis

from chatloom.app.state.redis_connection import RedisHub
from chatloom.app.state.stop_relay import RedisStopRelay

from backing_services import PrivateRedis


class _PubSub:
    def __init__(self, owner: "_Blocking") -> None:
        self.owner = owner

    async def __aenter__(self) -> "_PubSub":
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def subscribe(self, channel: str) -> None:
        self.owner.attempts += 1
        if self.owner.attempts <= self.owner.failures:
            raise redis.ConnectionError("Connection refused")

    async def listen(self):
        await asyncio.Event().wait()  # subscribed: nothing is published in this test
        yield {}


class _Blocking:
    def __init__(self, failures: int) -> None:
        self.failures, self.attempts = failures, 0

    def pubsub(self) -> _PubSub:
        return _PubSub(self)


async def test_a_redis_outage_is_logged_once_and_its_end_once(caplog):
    blocking = _Blocking(failures=4)
    relay = RedisStopRelay(commands=None, blocking=blocking)
    with caplog.at_level(logging.DEBUG, logger="chatloom.app.state.stop_relay"):
        await relay.start(lambda cid: asyncio.sleep(0))
        await asyncio.wait_for(relay.listening.wait(), timeout=30)
        await relay.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert blocking.attempts == 5
    assert len(warnings) == 2, warnings
    assert "lost Redis" in warnings[0] and "listening again after" in warnings[1]
    assert sum("still without Redis" in r.getMessage() for r in caplog.records) == 3


def _dead_sockets_to(port: int) -> int:
    """This process's TCP sockets to `port` that the other end has closed (CLOSE_WAIT)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    dead = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "08" and cols[9] in mine and int(cols[2].rsplit(":", 1)[1], 16) == port:
                dead += 1
    return dead


async def test_idle_sockets_to_a_restarted_redis_are_closed_once_it_is_back():
    """redis-py finds a dead pooled socket only when it uses it: after a restart, the sockets left idle
    would stay open (CLOSE_WAIT) until the gateway stops. The relay, which notices an outage, has them
    closed once Redis is back."""
    server = PrivateRedis().start()
    hub = RedisHub(server.url)
    back = asyncio.Event()

    async def on_back() -> None:
        await hub.drop_idle()
        back.set()

    relay = RedisStopRelay(hub.commands, hub.blocking, on_back=on_back)
    try:
        await relay.start(lambda cid: asyncio.sleep(0))
        await asyncio.wait_for(relay.listening.wait(), timeout=10)
        pool = hub.commands.connection_pool
        held = [await pool.get_connection() for _ in range(3)]  # three sockets, then idle in the pool
        for conn in held:
            await conn.connect()
            await pool.release(conn)
        server.stop()
        while relay.listening.is_set():  # Redis down long enough for the relay to see it go
            await asyncio.sleep(0.01)
        server.start()
        await asyncio.wait_for(back.wait(), timeout=30)  # the relay resubscribed after the restart
        assert _dead_sockets_to(server.port) == 0
        assert await hub.commands.ping()  # the pool reconnects as before
    finally:
        await relay.close()
        await hub.close()
        server.stop()
