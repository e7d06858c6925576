"""Accounts: sign up, log in, API keys."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.auth import current_user, new_api_key
from chatloom.app.deps import get_context, get_session
from chatloom.app.errors import ApiError, not_found
from chatloom.app.schemas import ApiKeyIn, Credentials, LoginIn, api_key_out
from chatloom.store import ApiKeys, User, Users

router = APIRouter(prefix="/auth", tags=["auth"])


def _user_out(user: User) -> dict:
    return {"id": user.id, "username": user.username, "is_admin": user.is_admin, "tier": user.tier}


@router.post("/signup", status_code=201)
async def signup(body: Credentials, request: Request, session: AsyncSession = Depends(get_session)) -> dict:
    ctx = get_context(request)
    users = Users(session)
    if not ctx.settings.allow_signup and await users.count() > 0:
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
    return {"token": ctx.tokens.issue(user.id), "user": _user_out(user)}


@router.post("/login")
async def login(body: LoginIn, request: Request, session: AsyncSession = Depends(get_session)) -> dict:
    ctx = get_context(request)
    user = await Users(session).by_username(body.username)
    # Same answer for a wrong name and a wrong password, so names cannot be probed.
    if user is None or not await ctx.passwords.verify(user.password_hash, body.password):
        raise ApiError(401, "wrong username or password", "invalid_credentials")
    return {"token": ctx.tokens.issue(user.id), "user": _user_out(user)}


@router.get("/me")
async def me(user: User = Depends(current_user)) -> dict:
    return _user_out(user)


@router.post("/api-keys", status_code=201)
async def create_api_key(body: ApiKeyIn | None = None, user: User = Depends(current_user),
                         session: AsyncSession = Depends(get_session)) -> dict:
    key, prefix, key_hash = new_api_key()
    row = await ApiKeys(session).create(user.id, (body.name if body else "").strip(), prefix, key_hash)
    await session.commit()
    return {**api_key_out(row), "key": key}  # the only time the key is shown


@router.get("/api-keys")
async def list_api_keys(user: User = Depends(current_user), session: AsyncSession = Depends(get_session)) -> list:
    return [api_key_out(k) for k in await ApiKeys(session).for_user(user.id)]


@router.delete("/api-keys/{key_id}", status_code=204)
async def revoke_api_key(key_id: str, user: User = Depends(current_user),
                         session: AsyncSession = Depends(get_session)) -> Response:
    if not await ApiKeys(session).delete(user.id, key_id):
        raise not_found("api key")
    await session.commit()
    return Response(status_code=204)
