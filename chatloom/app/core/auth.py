"""Passwords (argon2), session tokens (signed, expiring JWTs), API keys (random, stored as sha256).

Pure crypto and tokens, no FastAPI: turning an Authorization header into a user is deps.current_user."""
from __future__ import annotations

import asyncio
import hashlib
import secrets
import time

import jwt
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

API_KEY_PREFIX = "cl-"
JWT_ALGORITHM = "HS256"


class Passwords:
    """argon2id hashing, run off the event loop (it is deliberately slow)."""

    def __init__(self, time_cost: int = 3, memory_kib: int = 65536) -> None:
        self._hasher = PasswordHasher(time_cost=time_cost, memory_cost=memory_kib)
        self._stand_in_hash: str | None = None  # made on first need, with the same cost parameters

    async def hash(self, password: str) -> str:
        return await asyncio.to_thread(self._hasher.hash, password)

    async def verify(self, password_hash: str | None, password: str) -> bool:
        """Whether the password matches. Without a hash (an unknown user, an account without a password)
        a stand-in hash is checked all the same, so the answer takes as long either way and timing does
        not tell which names exist."""
        try:
            if not password_hash:
                await asyncio.to_thread(self._hasher.verify, await self._stand_in(), password)
                return False
            return await asyncio.to_thread(self._hasher.verify, password_hash, password)
        except (VerificationError, InvalidHashError):
            return False

    async def _stand_in(self) -> str:
        if self._stand_in_hash is None:
            self._stand_in_hash = await self.hash(secrets.token_urlsafe(16))
        return self._stand_in_hash


class Tokens:
    """HS256 JWTs whose subject is the user id."""

    def __init__(self, secret: str, ttl_s: int) -> None:
        self._secret = secret
        self.ttl_s = ttl_s

    def issue(self, user_id: str, session_version: int = 0) -> str:
        """A token for the account; `session_version` is the account's, so raising it (signing out
        everywhere) makes every token issued before invalid."""
        now = int(time.time())
        return jwt.encode({"sub": user_id, "sv": session_version, "iat": now, "exp": now + self.ttl_s},
                          self._secret, JWT_ALGORITHM)

    def verify(self, token: str) -> tuple[str, int] | None:
        """(user id, session version) of a valid, unexpired token; None otherwise."""
        try:
            claims = jwt.decode(token, self._secret, algorithms=[JWT_ALGORITHM], options={"require": ["exp", "sub"]})
        except jwt.PyJWTError:
            return None
        sub, version = claims.get("sub"), claims.get("sv", 0)
        if not isinstance(sub, str) or not isinstance(version, int):
            return None
        return sub, version

    def subject(self, token: str) -> str | None:
        """The user id in a valid, unexpired token; None otherwise."""
        verified = self.verify(token)
        return verified[0] if verified else None


def new_api_key() -> tuple[str, str, str]:
    """(key, display prefix, stored hash). Keys carry 256 random bits, so a plain sha256 is a safe
    lookup hash (unlike passwords, they cannot be guessed from a dictionary)."""
    key = API_KEY_PREFIX + secrets.token_urlsafe(32)
    return key, key[:10], hash_api_key(key)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
