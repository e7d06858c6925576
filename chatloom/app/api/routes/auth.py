"""Accounts: sign up, log in, API keys."""
from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Request, Response
from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

from chatloom.app.core.audit import client_address
from chatloom.app.core.auth import new_api_key
from chatloom.app.core.scopes import format_scopes
from chatloom.app.core.sign_in_limits import SignInLimits
from chatloom.app.api.deps import Ctx, CurrentUser, SessionDep
from chatloom.app.core.errors import ApiError, not_found
from chatloom.app.api.openapi_responses import SIGNED_IN, errors
from chatloom.app.api.schemas import (ApiKeyCreated, ApiKeyIn, ApiKeyOut, Credentials, LoginIn, SessionOut, UserOut,
                                      iso)
from chatloom.app.state.stop_relay import stop_anywhere
from chatloom.store import ApiKeys, Conversation, Conversations, User, Users
from chatloom.store.models import utcnow

router = APIRouter(prefix="/auth", tags=["auth"])


@router.post("/signup", status_code=201, response_model=SessionOut, responses=errors(403, 409, 429))
async def signup(body: Credentials, request: Request, ctx: Ctx, session: SessionDep) -> SessionOut:
    _local_login(ctx)
    await _limits(ctx).signup_attempt(client_address(request))
    users = Users(session)
    if not ctx.settings.accounts.allow_signup and await users.count() > 0:
        raise ApiError(403, "sign-up is closed on this server", "signup_closed")
    if await users.by_username(body.username) is not None:
        raise ApiError(409, f"the username {body.username!r} is taken", "username_taken", "username")
    password_hash = await ctx.passwords.hash(body.password)
    # The first account administers the server.
    user = await users.create(body.username, password_hash, is_admin=await users.count() == 0)
    try:
        await session.commit()
    except IntegrityError:  # lost a race for the same name
        raise ApiError(409, f"the username {body.username!r} is taken", "username_taken", "username") from None
    await _audit(ctx, "auth.signup", request, user.id, user.username, detail={"admin": user.is_admin})
    return SessionOut(token=ctx.tokens.issue(user.id, user.session_version or 0), user=UserOut.of(user))


@router.post("/login", response_model=SessionOut, responses=errors(401, 403, 429))
async def login(body: LoginIn, request: Request, ctx: Ctx, session: SessionDep) -> SessionOut:
    _local_login(ctx)
    limits, address = _limits(ctx), client_address(request)
    try:
        await limits.check_login(body.username, address)
    except ApiError:
        await _audit(ctx, "auth.login_limited", request, None, body.username, status=429)
        raise
    user = await Users(session).by_username(body.username)
    # Same answer, in about the same time, for a wrong name and a wrong password, so names cannot be probed.
    if not await ctx.passwords.verify(user.password_hash if user else None, body.password) or user is None:
        await limits.failed_login(body.username, address)
        await _audit(ctx, "auth.login_failed", request, user.id if user else None, body.username, status=401)
        raise ApiError(401, "wrong username or password", "invalid_credentials")
    await limits.signed_in(body.username)
    await _audit(ctx, "auth.login", request, user.id, user.username)
    return SessionOut(token=ctx.tokens.issue(user.id, user.session_version or 0), user=UserOut.of(user))


def _limits(ctx: Ctx) -> SignInLimits:
    return SignInLimits(ctx.hot.attempts, ctx.settings.accounts)


async def _audit(ctx: Ctx, action: str, request: Request, actor_id: str | None, actor_name: str | None,
                 **fields) -> None:
    if ctx.audit is not None:
        await ctx.audit.record(action, request=request, actor_id=actor_id, actor_name=actor_name, **fields)


def _local_login(ctx: Ctx) -> None:
    """Passwords are refused where single sign-on is on and local accounts are turned off."""
    if ctx.settings.sso.enabled and not ctx.settings.sso.local_login:
        raise ApiError(403, "this server signs in with single sign-on only (GET /auth/sso/login)", "sso_only")


@router.get("/me", response_model=UserOut, responses=SIGNED_IN)
async def me(user: CurrentUser) -> UserOut:
    return UserOut.of(user)


@router.post("/api-keys", status_code=201, response_model=ApiKeyCreated, responses=errors(400, 401, 403))
async def create_api_key(user: CurrentUser, request: Request, ctx: Ctx, session: SessionDep,
                         body: ApiKeyIn | None = None) -> ApiKeyCreated:
    body = body or ApiKeyIn()
    scopes = set(body.scopes)
    if "admin" in scopes and not user.is_admin:
        raise ApiError(403, "only an admin account can make a key with the 'admin' scope", "forbidden", "scopes")
    held = getattr(request.state, "scopes", None)  # made with a key: never more than that key may do
    if held is not None and not scopes <= held:
        raise ApiError(403, f"a key can only make keys within its own scopes ({format_scopes(held)})",
                       "insufficient_scope", "scopes")
    days, cap = body.expires_in_days, ctx.settings.accounts.api_key_max_days
    if cap is not None and (days is None or days > cap):
        if days is not None:
            raise ApiError(400, f"expires_in_days is {days}; this server allows at most {cap}", "invalid_value",
                           "expires_in_days")
        days = cap
    expires_at = utcnow() + timedelta(days=days) if days else None
    key, prefix, key_hash = new_api_key()
    row = await ApiKeys(session).create(user.id, body.name.strip(), prefix, key_hash, format_scopes(scopes),
                                        expires_at)
    await session.commit()
    await _audit(ctx, "auth.api_key_created", request, user.id, user.username, target=row.id,
                 detail={"scopes": row.scopes, "expires_at": iso(expires_at)})
    return ApiKeyCreated(**ApiKeyOut.of(row).model_dump(), key=key)  # the only time the key is shown


@router.get("/api-keys", response_model=list[ApiKeyOut], responses=SIGNED_IN)
async def list_api_keys(user: CurrentUser, session: SessionDep) -> list[ApiKeyOut]:
    return [ApiKeyOut.of(k) for k in await ApiKeys(session).for_user(user.id)]


@router.delete("/api-keys/{key_id}", status_code=204, responses=errors(401, 404))
async def revoke_api_key(key_id: str, user: CurrentUser, request: Request, ctx: Ctx,
                         session: SessionDep) -> Response:
    if not await ApiKeys(session).delete(user.id, key_id):
        raise not_found("api key")
    await session.commit()
    ctx.callers.forget_user(user.id)  # the revoked key stops working here at once
    await _audit(ctx, "auth.api_key_revoked", request, user.id, user.username, target=key_id)
    return Response(status_code=204)


@router.post("/revoke-all", status_code=204, responses=errors(401))
async def revoke_everything(user: CurrentUser, request: Request, ctx: Ctx, session: SessionDep) -> Response:
    """Sign the account out everywhere: every session token issued so far and every API key stop working
    (on this gateway at once, on others within accounts.auth_cache_s). Sign in again for a new session."""
    keys = await ApiKeys(session).delete_all(user.id)
    await session.execute(update(User).where(User.id == user.id)
                          .values(session_version=User.session_version + 1))
    await session.commit()
    ctx.callers.forget_user(user.id)
    await _audit(ctx, "auth.revoke_all", request, user.id, user.username, detail={"api_keys": keys})
    return Response(status_code=204)


@router.delete("/me", status_code=204, responses=errors(401, 503))
async def delete_account(user: CurrentUser, request: Request, ctx: Ctx, session: SessionDep) -> Response:
    """Delete the caller's account and everything of theirs for good: running answers are stopped; its
    conversations, files (rows, passages, vectors and bytes), collections, API keys and usage go."""
    conversation_ids = list(await session.scalars(select(Conversation.id).where(Conversation.user_id == user.id)))
    for cid in conversation_ids:
        await stop_anywhere(cid, ctx.conversations.stop, ctx.hot.jobs, ctx.hot.stops, ctx.conversations.logs)
    await ctx.files.delete_for_user(session, user.id)
    for cid in conversation_ids:
        await Conversations(session).delete(cid)
    await session.execute(delete(User).where(User.id == user.id))  # keys, usage, feedback: ON DELETE CASCADE
    await session.commit()
    ctx.callers.forget_user(user.id)
    await _audit(ctx, "auth.account_deleted", request, user.id, user.username)
    return Response(status_code=204)
