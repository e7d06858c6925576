"""The stop relay while Redis is away: one line when it goes, one when it is back, not one every retry."""
from __future__ import annotations

import asyncio
import logging

import redis.asyncio as redis

from chatloom.app.state.stop_relay import RedisStopRelay


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
