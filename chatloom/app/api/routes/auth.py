"""Accounts: sign up, log in, API keys."""
from __future__ import annotations

from fastapi import APIRouter, Response
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from chatloom.app.core.auth import new_api_key
from chatloom.app.api.deps import Ctx, CurrentUser, SessionDep
from chatloom.app.core.errors import ApiError, not_found
from chatloom.app.api.openapi_responses import SIGNED_IN, errors
from chatloom.app.api.schemas import ApiKeyCreated, ApiKeyIn, ApiKeyOut, Credentials, LoginIn, SessionOut, UserOut
from chatloom.app.state.stop_relay import stop_anywhere
from chatloom.store import ApiKeys, Conversation, Conversations, User, Users

router = APIRouter(prefix="/auth", tags=["auth"])


@router.post("/signup", status_code=201, response_model=SessionOut, responses=errors(403, 409))
async def signup(body: Credentials, ctx: Ctx, session: SessionDep) -> SessionOut:
    _local_login(ctx)
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
    return SessionOut(token=ctx.tokens.issue(user.id), user=UserOut.of(user))


@router.post("/login", response_model=SessionOut, responses=errors(401, 403))
async def login(body: LoginIn, ctx: Ctx, session: SessionDep) -> SessionOut:
    _local_login(ctx)
    user = await Users(session).by_username(body.username)
    # Same answer for a wrong name and a wrong password, so names cannot be probed.
    if user is None or not await ctx.passwords.verify(user.password_hash, body.password):
        raise ApiError(401, "wrong username or password", "invalid_credentials")
    return SessionOut(token=ctx.tokens.issue(user.id), user=UserOut.of(user))


def _local_login(ctx: Ctx) -> None:
    """Passwords are refused where single sign-on is on and local accounts are turned off."""
    if ctx.settings.sso.enabled and not ctx.settings.sso.local_login:
        raise ApiError(403, "this server signs in with single sign-on only (GET /auth/sso/login)", "sso_only")


@router.get("/me", response_model=UserOut, responses=SIGNED_IN)
async def me(user: CurrentUser) -> UserOut:
    return UserOut.of(user)


@router.post("/api-keys", status_code=201, response_model=ApiKeyCreated, responses=SIGNED_IN)
async def create_api_key(user: CurrentUser, session: SessionDep, body: ApiKeyIn | None = None) -> ApiKeyCreated:
    key, prefix, key_hash = new_api_key()
    row = await ApiKeys(session).create(user.id, (body.name if body else "").strip(), prefix, key_hash)
    await session.commit()
    return ApiKeyCreated(**ApiKeyOut.of(row).model_dump(), key=key)  # the only time the key is shown


@router.get("/api-keys", response_model=list[ApiKeyOut], responses=SIGNED_IN)
async def list_api_keys(user: CurrentUser, session: SessionDep) -> list[ApiKeyOut]:
    return [ApiKeyOut.of(k) for k in await ApiKeys(session).for_user(user.id)]


@router.delete("/api-keys/{key_id}", status_code=204, responses=errors(401, 404))
async def revoke_api_key(key_id: str, user: CurrentUser, ctx: Ctx, session: SessionDep) -> Response:
    if not await ApiKeys(session).delete(user.id, key_id):
        raise not_found("api key")
    await session.commit()
    ctx.callers.forget_user(user.id)  # the revoked key stops working here at once
    return Response(status_code=204)


@router.delete("/me", status_code=204, responses=errors(401, 503))
async def delete_account(user: CurrentUser, ctx: Ctx, session: SessionDep) -> Response:
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
    return Response(status_code=204)
