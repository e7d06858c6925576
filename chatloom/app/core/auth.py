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

    async def hash(self, password: str) -> str:
        return await asyncio.to_thread(self._hasher.hash, password)

    async def verify(self, password_hash: str | None, password: str) -> bool:
        if not password_hash:
            return False
        try:
            return await asyncio.to_thread(self._hasher.verify, password_hash, password)
        except (VerificationError, InvalidHashError):
            return False


class Tokens:
    """HS256 JWTs whose subject is the user id."""

    def __init__(self, secret: str, ttl_s: int) -> None:
        self._secret = secret
        self.ttl_s = ttl_s

    def issue(self, user_id: str) -> str:
        now = int(time.time())
        return jwt.encode({"sub": user_id, "iat": now, "exp": now + self.ttl_s}, self._secret, JWT_ALGORITHM)

    def subject(self, token: str) -> str | None:
        """The user id in a valid, unexpired token; None otherwise."""
        try:
            claims = jwt.decode(token, self._secret, algorithms=[JWT_ALGORITHM], options={"require": ["exp", "sub"]})
        except jwt.PyJWTError:
            return None
        sub = claims.get("sub")
        return sub if isinstance(sub, str) else None


def new_api_key() -> tuple[str, str, str]:
    """(key, display prefix, stored hash). Keys carry 256 random bits, so a plain sha256 is a safe
    lookup hash (unlike passwords, they cannot be guessed from a dictionary)."""
    key = API_KEY_PREFIX + secrets.token_urlsafe(32)
    return key, key[:10], hash_api_key(key)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
