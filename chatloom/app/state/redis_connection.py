"""The Redis connections of one gateway, and what a lost Redis means for a request.

Two clients on the same server: `commands` with short timeouts for the quick calls (a quota
check, an append), so a Redis that is gone makes a request fail in about a second with a 503
rather than hang; and `blocking` without a read timeout, for stream reads that wait (XREAD BLOCK)
and the pub/sub listener. redis-py reconnects by itself on the next call, so when Redis comes back
the gateway recovers without a restart.
"""
from __future__ import annotations

import logging

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

# What "Redis is out of reach" looks like from redis-py (connection refused, reset, timed out).
UNAVAILABLE = (RedisConnectionError, RedisTimeoutError)
COMMAND_CONNECTIONS = 32  # sockets per gateway for plain commands (blocking reads have their own)
POOL_WAIT_S = 10.0  # longest wait for a free socket; Redis down fails at connect, long before this
# Sockets per gateway for blocking reads: one per stream being read at once (XREAD BLOCK holds its socket).
# redis-py's pool defaults to 100, which failed the 101st concurrent stream; this is Redis's own maxclients.
BLOCKING_CONNECTIONS = 10_000

log = logging.getLogger(__name__)


class RedisHub:
    """The gateway's clients for one Redis URL."""

    def __init__(self, url: str, timeout_s: float = 1.0) -> None:
        self.url = url
        # One quick retry covers a connection Redis closed while idle (a restart); a second failure is real.
        retry = Retry(NoBackoff(), 1)
        # Commands share a bounded pool: a burst (hundreds of requests at once) waits its turn for one of
        # COMMAND_CONNECTIONS sockets instead of opening a socket each, which made Redis answer some of
        # them after the 1 s timeout, and those requests got 503s with Redis perfectly healthy.
        pool = redis.BlockingConnectionPool.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                                     retry=retry, health_check_interval=5,
                                                     max_connections=COMMAND_CONNECTIONS, timeout=POOL_WAIT_S)
        self.commands: redis.Redis = redis.Redis.from_pool(pool)  # closes the pool with the client
        self.blocking: redis.Redis = redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=None,
                                                    retry=retry, health_check_interval=5,
                                                    max_connections=BLOCKING_CONNECTIONS)

    @property
    def where(self) -> str:
        kw = self.commands.connection_pool.connection_kwargs
        return f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"

    async def ping(self) -> None:
        """Raises if Redis does not answer within the timeout."""
        await self.commands.ping()

    async def drop_idle(self) -> None:
        """Close the idle pooled sockets (after Redis came back from a restart). redis-py finds a dead
        socket only when it uses it, and its pools hand out the newest first: a socket left idle at
        the bottom of a pool would otherwise stay open to a server that is gone, until the gateway stops."""
        for client in (self.commands, self.blocking):
            try:
                await client.connection_pool.disconnect(inuse_connections=False)
            except Exception as exc:  # noqa: BLE001 - closing a dead socket may fail; it is gone either way
                log.debug("dropping idle Redis sockets: %r", exc)

    async def close(self) -> None:
        await self.commands.aclose()
        await self.blocking.aclose()


def unavailable_message(hub_where: str, exc: BaseException) -> str:
    return (f"the shared state store (Redis at {hub_where}) is unreachable ({type(exc).__name__}: {exc}); "
            "retry shortly")


__all__ = ["RedisHub", "RedisError", "UNAVAILABLE", "unavailable_message"]
