"""FastAPI dependencies: the shared application context, one DB session per request, the caller
(from a session token or an API key), the admin check, and the caller's own conversation.

Routes use the `Annotated` shorthands: `SessionDep`, `CurrentUser`, `AdminUser`, `Ctx`, `OwnedConversation`.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Annotated, AsyncIterator

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.core.auth import API_KEY_PREFIX, Passwords, Tokens, hash_api_key
from chatloom.app.core.audit import AuditLog
from chatloom.app.core.caller_cache import CallerCache, Grant
from chatloom.app.core.scopes import format_scopes, parse_scopes, scope_for
from chatloom.app.chat.conversation_service import ConversationService
from chatloom.app.core.errors import ApiError, not_found
from chatloom.app.files.retrieval import Retriever
from chatloom.app.files.service import Files
from chatloom.app.tools.hosted import HostedToolbox
from chatloom.app.state.hot_state import HotState
from chatloom.app.generation.pipeline import Pipeline
from chatloom.settings import Settings
from chatloom.app.traffic.control import Traffic
from chatloom.serving import Backend
from chatloom.serving.local_scaler import LocalFleetScaler
from chatloom.store import ApiKeys, Conversation, Conversations, Database, User, Users
from chatloom.store.blobs import BlobStore
from chatloom.serving.speech import SpeechBackend


@dataclass
class AppContext:
    """Everything the routes share, built once by create_app."""

    settings: Settings
    db: Database
    backend: Backend
    passwords: Passwords
    tokens: Tokens
    traffic: Traffic
    pipeline: Pipeline
    conversations: ConversationService
    hot: HotState  # quotas, stream logs, stops, job leases: in memory, or shared by the gateways in Redis
    callers: CallerCache  # recently authenticated callers (spares the database a lookup per request)
    blobs: BlobStore  # uploaded files' bytes (rows in the files table say whose and what)
    files: Files  # a user's files for retrieval: upload, index, attach, delete (app/files/)
    retriever: Retriever  # their passages for a question
    speech: SpeechBackend | None = None  # speech to text, where a Whisper model is set ([speech] model)
    scaler: LocalFleetScaler | None = None  # the predictive autoscaler, when it is on
    hosted: HostedToolbox | None = None  # the built-in tools the OpenAI-shaped APIs run on the server
    audit: AuditLog | None = None  # admin actions and security events (core/audit.py)


def get_context(request: Request) -> AppContext:
    return request.app.state.ctx


async def _context(request: Request) -> AppContext:
    # async on purpose: FastAPI runs a plain `def` dependency in its thread pool, a thread hop per request
    # that, under a burst, queues every request behind the pool and the GIL.
    return get_context(request)


Ctx = Annotated[AppContext, Depends(_context)]


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """A session for this request; whatever was not committed is rolled back when it closes."""
    session = get_context(request).db.session()
    try:
        yield session
    finally:
        if session.in_transaction():
            # Shielded, as AsyncSession's own `async with` closes: a cancelled request still hands its
            # connection back cleanly.
            await asyncio.shield(session.close())
        else:
            # Nothing to roll back or hand back: close inline. (The shielded close costs a turn of the
            # event loop, and under a burst that turn waits behind every other request.)
            await session.close()


SessionDep = Annotated[AsyncSession, Depends(get_session)]


def _unauthorized(message: str, code: str) -> ApiError:
    return ApiError(401, message, code, headers={"WWW-Authenticate": "Bearer"})


# Declares the bearer scheme in the OpenAPI schema of every route that needs a caller; the header itself is
# read below, so a missing or malformed one gets this API's own 401 rather than FastAPI's 403.
bearer = HTTPBearer(auto_error=False, scheme_name="bearer",
                    description="a session token (POST /auth/login or /auth/signup) or an API key (POST /auth/api-keys)")


# Anthropic's SDKs send the API key in this header instead.
api_key_header = APIKeyHeader(name="x-api-key", auto_error=False, scheme_name="x-api-key",
                              description="an API key (POST /auth/api-keys), as Anthropic's clients send it")


def _credential(request: Request) -> str:
    """The credential from `Authorization: Bearer ...`, or else an API key from `x-api-key`."""
    header = request.headers.get("authorization")
    if not header:
        key = request.headers.get("x-api-key", "").strip()
        if not key:
            raise _unauthorized("missing Authorization header: send 'Bearer <token or API key>' "
                                "(or the API key in x-api-key)", "missing_token")
        if not key.startswith(API_KEY_PREFIX):
            raise _unauthorized(f"x-api-key must hold an API key (it starts with {API_KEY_PREFIX!r}); send a "
                                "session token as 'Authorization: Bearer <token>'", "invalid_api_key")
        return key
    scheme, _, credential = header.partition(" ")
    credential = credential.strip()
    if scheme.lower() != "bearer" or not credential:
        raise _unauthorized("the Authorization header must be 'Bearer <token or API key>'", "invalid_token")
    return credential


async def current_user(request: Request, session: SessionDep,
                       _declared: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)] = None,
                       _key: Annotated[str | None, Security(api_key_header)] = None) -> User:
    """The caller, from `Authorization: Bearer <session token | API key>` or `x-api-key: <API key>`."""
    credential = _credential(request)
    ctx = get_context(request)
    if credential.startswith(API_KEY_PREFIX):
        key_hash = hash_api_key(credential)
        cache_key = "key:" + key_hash
        found = ctx.callers.get_with_grant(cache_key) or await ctx.callers.load_once(
            cache_key, lambda: _key_owner(ctx, session, cache_key, key_hash))
        user, grant = found
        _check_grant(request, grant)
    else:
        verified = ctx.tokens.verify(credential)  # verified on every request; only the lookup is cached
        if verified is None:
            raise _unauthorized("invalid or expired token", "invalid_token")
        user_id, version = verified
        cache_key = "usr:" + user_id
        user = ctx.callers.get(cache_key) or await ctx.callers.load_once(
            cache_key, lambda: _look_up(ctx, session, cache_key, user_id))
        if version != (user.session_version or 0):
            raise _unauthorized("this session was signed out; sign in again", "session_revoked")
        request.state.scopes = None  # a signed-in person holds every right of the account
    request.state.user = user  # for the x-ratelimit-* headers on the response
    return user


def _check_grant(request: Request, grant: Grant | None) -> None:
    """An API key works until it expires, and only for what its scopes allow (core/scopes.py)."""
    if grant is None:
        return
    scopes, expires = grant
    if expires is not None and time.time() >= expires:
        raise _unauthorized("this API key has expired", "api_key_expired")
    needed = scope_for(request.method, request.url.path)
    if needed not in scopes:
        raise ApiError(403, f"this API key lacks the {needed!r} scope this request needs "
                            f"(it has: {format_scopes(scopes) or 'none'})", "insufficient_scope")
    request.state.scopes = scopes


async def _key_owner(ctx: AppContext, session: AsyncSession, cache_key: str,
                     key_hash: str) -> tuple[User, Grant]:
    """The account behind an API key and what the key may do, its last use noted."""
    keys = ApiKeys(session)
    key = await keys.by_hash(key_hash)
    if key is None:
        raise _unauthorized("invalid API key", "invalid_api_key")
    if await keys.touch(key):
        await session.commit()
    expires = key.expires_at.timestamp() if key.expires_at is not None else None
    grant = (parse_scopes(key.scopes), expires)
    return await _look_up(ctx, session, cache_key, key.user_id, grant), grant


async def _look_up(ctx: AppContext, session: AsyncSession, cache_key: str, user_id: str,
                   grant: Grant | None = None) -> User:
    """The account from the database, remembered for auth_cache_s (from now: a hit does not extend it,
    so changes made elsewhere are seen within that time however often the caller comes back)."""
    user = await Users(session).get(user_id)
    if user is None:
        raise _unauthorized("the account behind this credential no longer exists", "invalid_token")
    ctx.callers.put(cache_key, user, grant)
    return user


CurrentUser = Annotated[User, Depends(current_user)]


async def require_admin(user: CurrentUser) -> User:  # async: no thread hop (see _context)
    """The caller, who must be an admin (the one admin check of the API)."""
    if not user.is_admin:
        raise ApiError(403, "admins only", "forbidden")
    return user


AdminUser = Annotated[User, Depends(require_admin)]


async def owned_conversation(conversation_id: str, user: CurrentUser, session: SessionDep) -> Conversation:
    """The conversation, if it is the caller's; 404 otherwise (someone else's is not even acknowledged)."""
    conv = await Conversations(session).get_owned(user.id, conversation_id)
    if conv is None:
        raise not_found("conversation")
    return conv


OwnedConversation = Annotated[Conversation, Depends(owned_conversation)]
