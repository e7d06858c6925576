"""Sign-in and sign-up attempts counted in Redis, shared by every gateway (app/core/attempts.py)."""
from __future__ import annotations

import math


class RedisAttempts:
    def __init__(self, redis, prefix: str) -> None:
        self.r = redis
        self.prefix = f"{prefix}:attempts:"

    async def peek(self, key: str) -> tuple[int, float]:
        async with self.r.pipeline(transaction=True) as pipe:
            count, ttl_ms = await pipe.get(self.prefix + key).pttl(self.prefix + key).execute()
        if count is None or ttl_ms is None or ttl_ms < 0:
            return 0, 0.0
        return int(count), ttl_ms / 1000

    async def add(self, key: str, window_s: float) -> int:
        name = self.prefix + key
        # The window starts at the first attempt: the expiry is set only where none is (EXPIRE NX).
        async with self.r.pipeline(transaction=True) as pipe:
            count, _ = await pipe.incr(name).expire(name, max(1, math.ceil(window_s)), nx=True).execute()
        return int(count)

    async def clear(self, key: str) -> None:
        await self.r.delete(self.prefix + key)
