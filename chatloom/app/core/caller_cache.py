"""Recently authenticated callers, remembered for a few seconds, so a burst of requests from the same
users does not queue behind the database.

Every authenticated request used to look its caller up (the account behind a session token, or an
API key and then its account): a database round trip through the connection pool and the driver's
thread. Under a burst, 200 requests arriving at once waited for each other there before anything could
decide to refuse them (issue 12: overload must be refused in well under 100 ms). The cache maps a
credential (the user id a verified session token names, or an API key's hash) to a detached copy of
the account for `ttl_s` seconds. Session tokens are still verified on every request; only the lookup
is spared. Changes made through this gateway (a tier set, an API key revoked) drop the user's entries
at once; other gateways see them within `ttl_s`.

Lookups of one credential that miss at the same time share one trip to the database: a thousand
streams opened at once with one API key would otherwise take a thousand pooled connections (and on
SQLite a thousand writes of the key's last use) before the first answer could start.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

from chatloom.store import User

T = TypeVar("T")

# What an API key may do: (scopes, expiry as a POSIX time or None); None for a session token.
Grant = tuple[frozenset[str], float | None]

_MAX_ENTRIES = 10_000  # a bound on memory; when full, the oldest entries go


class CallerCache:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        # credential key -> (expiry, account copy, the key's grant)
        self._entries: dict[str, tuple[float, User, Grant | None]] = {}
        self._loading: dict[str, asyncio.Future] = {}  # credential key -> the lookup in flight

    async def load_once(self, key: str, loader: Callable[[], Awaitable[T]]) -> T:
        """`loader()`'s result (an account, or an account and a key's grant), or the result (or error) of
        the lookup of `key` already in flight."""
        while (pending := self._loading.get(key)) is not None:
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                if not pending.cancelled():  # this request was cancelled, not the one looking up
                    raise
        future = asyncio.get_running_loop().create_future()
        self._loading[key] = future
        try:
            user = await loader()
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()  # the waiters look up themselves
            else:
                future.set_exception(exc)
                future.exception()  # retrieved: no warning when nobody was waiting
            raise
        finally:
            if self._loading.get(key) is future:
                del self._loading[key]
        future.set_result(user)
        return user

    def get(self, key: str) -> User | None:
        found = self.get_with_grant(key)
        return found[0] if found else None

    def get_with_grant(self, key: str) -> tuple[User, Grant | None] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, user, grant = entry
        if self.clock() >= expires:
            del self._entries[key]
            return None
        return user, grant

    def put(self, key: str, user: User, grant: Grant | None = None) -> None:
        if self.ttl_s <= 0:
            return
        if len(self._entries) >= _MAX_ENTRIES:
            for old in list(self._entries)[: _MAX_ENTRIES // 10]:  # insertion order: the oldest first
                del self._entries[old]
        self._entries[key] = (self.clock() + self.ttl_s, _detached_copy(user), grant)

    def forget_user(self, user_id: str) -> None:
        """Drop every credential of this account (its tier changed, one of its keys was revoked)."""
        for key in [k for k, (_, u, _g) in self._entries.items() if u.id == user_id]:
            del self._entries[key]


def _detached_copy(user: User) -> User:
    """A copy no database session owns, safe to hand to many requests at once."""
    return User(id=user.id, username=user.username, password_hash=None, is_admin=user.is_admin, tier=user.tier,
                created=user.created, session_version=user.session_version or 0)
