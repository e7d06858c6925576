"""Passwords (argon2), session tokens (signed, expiring JWTs), API keys (random, stored as sha256),
and the FastAPI dependency that turns an Authorization header into a user."""
from __future__ import annotations

import asyncio
import hashlib
import secrets
import time

import jwt
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.deps import get_context, get_session
from chatloom.app.errors import ApiError
from chatloom.store import ApiKeys, User, Users

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


def _unauthorized(message: str, code: str) -> ApiError:
    return ApiError(401, message, code, headers={"WWW-Authenticate": "Bearer"})


async def current_user(request: Request, session: AsyncSession = Depends(get_session)) -> User:
    """The caller, from `Authorization: Bearer <session token | API key>`."""
    header = request.headers.get("authorization")
    if not header:
        raise _unauthorized("missing Authorization header: send 'Bearer <token or API key>'", "missing_token")
    scheme, _, credential = header.partition(" ")
    credential = credential.strip()
    if scheme.lower() != "bearer" or not credential:
        raise _unauthorized("the Authorization header must be 'Bearer <token or API key>'", "invalid_token")
    ctx = get_context(request)
    if credential.startswith(API_KEY_PREFIX):
        keys = ApiKeys(session)
        key = await keys.by_hash(hash_api_key(credential))
        if key is None:
            raise _unauthorized("invalid API key", "invalid_api_key")
        if await keys.touch(key):
            await session.commit()
        user = await Users(session).get(key.user_id)
    else:
        user_id = ctx.tokens.subject(credential)
        if user_id is None:
            raise _unauthorized("invalid or expired token", "invalid_token")
        user = await Users(session).get(user_id)
    if user is None:
        raise _unauthorized("the account behind this credential no longer exists", "invalid_token")
    request.state.user = user  # for the x-ratelimit-* headers on the response
    return user
