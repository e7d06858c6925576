"""Single sign-on with OpenID Connect: what the login screen offers, leaving for the provider, and the
callback that signs the browser in. The session token reaches the browser app in the URL fragment of the
final redirect (/#sso_token=...), which browsers never send to a server or in a Referer. A browser whose
sign-in fails goes back to the login screen with the reason (/#sso_error=...) rather than to a page of
JSON; other clients get the JSON error.

A signed-in account connects an identity with the same flow: POST /auth/sso/connect sets a state cookie
that also names the account (signed, so it cannot be pointed elsewhere), and the same callback links the
identity instead of signing in, back to the app with /#sso_linked=1 or /#sso_link_error=...."""
from __future__ import annotations

from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import RedirectResponse
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.api.account_schemas import LinkedIdentityOut, SsoConnectOut, SsoInfo
from chatloom.app.api.deps import AppContext, Ctx, CurrentUser, SessionDep
from chatloom.app.api.openapi_responses import SIGNED_IN, errors
from chatloom.app.core.errors import ApiError
from chatloom.app.core.oidc import LinkTo, OidcClient, refused
from chatloom.app.core.sso_accounts import account_for, connect, disconnect, linked
from chatloom.store import User

router = APIRouter(prefix="/auth/sso", tags=["auth"])

COOKIE = "chatloom_sso"
COOKIE_PATH = "/auth/sso"
REDIRECT = {302: {"description": "A redirect: to the identity provider, or back to the app signed in."}}


def _client(request: Request, ctx: AppContext) -> OidcClient:
    sso = ctx.settings.sso
    if not sso.enabled or not sso.issuer or not sso.client_id:
        raise ApiError(404, "single sign-on is not set up on this server", "sso_disabled")
    client = getattr(request.app.state, "oidc", None)
    if client is None:  # one per app: it caches the provider's metadata and keys
        client = request.app.state.oidc = OidcClient(sso.issuer, sso.client_id, sso.client_secret, sso.scopes,
                                                     ctx.settings.secret(), sso.state_ttl_s)
    return client


def _browser(request: Request) -> bool:
    """A page load (the login button, the provider's redirect), not an API call."""
    return "text/html" in request.headers.get("accept", "")


def _back_to_login(error: ApiError, connecting: bool = False) -> RedirectResponse:
    response = RedirectResponse("/#" + urlencode({"sso_link_error" if connecting else "sso_error": error.message}),
                                status_code=302)
    response.delete_cookie(COOKIE, path=COOKIE_PATH)
    return response


def _set_state_cookie(response: Response, request: Request, ctx: AppContext, value: str) -> None:
    response.set_cookie(COOKIE, value, max_age=ctx.settings.sso.state_ttl_s, path=COOKIE_PATH,
                        httponly=True, samesite="lax", secure=request.url.scheme == "https")


def _signed_in_person(request: Request) -> None:
    """Sign-in methods change only by the person, signed in: an API key (leaked, or a script's) may not add a
    way into the account."""
    if getattr(request.state, "scopes", None) is not None:
        raise ApiError(403, "connecting or disconnecting single sign-on needs a signed-in session, not an API key",
                       "session_required")


def _redirect_uri(request: Request, ctx: AppContext) -> str:
    return ctx.settings.sso.redirect_url or str(request.url_for("sso_callback"))


@router.get("", response_model=SsoInfo)
async def sso_info(ctx: Ctx) -> SsoInfo:
    """What the login screen offers (no account needed)."""
    sso = ctx.settings.sso
    on = bool(sso.enabled and sso.issuer and sso.client_id)
    return SsoInfo(enabled=on, label=sso.button_label if on else None, local_login=sso.local_login or not on)


@router.get("/login", response_class=RedirectResponse, status_code=302, responses=REDIRECT | errors(404, 502))
async def sso_login(request: Request, ctx: Ctx) -> RedirectResponse:
    """Leave for the identity provider (authorization code with PKCE)."""
    try:
        sign_in = await _client(request, ctx).begin(_redirect_uri(request, ctx))
    except ApiError as error:
        if _browser(request):
            return _back_to_login(error)
        raise
    response = RedirectResponse(sign_in.url, status_code=302)
    _set_state_cookie(response, request, ctx, sign_in.state_cookie)
    return response


@router.post("/connect", response_model=SsoConnectOut, responses=errors(401, 403, 404, 502))
async def sso_connect(request: Request, response: Response, user: CurrentUser, ctx: Ctx) -> SsoConnectOut:
    """Begin connecting an identity at the provider to the signed-in account: the browser goes to `url`
    (this response set the state cookie) and the callback links the identity to this account."""
    _signed_in_person(request)
    link_to = LinkTo(user.id, user.session_version or 0)
    sign_in = await _client(request, ctx).begin(_redirect_uri(request, ctx), link_to)
    _set_state_cookie(response, request, ctx, sign_in.state_cookie)
    return SsoConnectOut(url=sign_in.url)


@router.get("/identities", response_model=list[LinkedIdentityOut], responses=SIGNED_IN)
async def linked_identities(user: CurrentUser, session: SessionDep) -> list[LinkedIdentityOut]:
    """The provider identities that sign in to this account."""
    return [LinkedIdentityOut.of(row) for row in await linked(session, user.id)]


@router.delete("/identities/{identity_id}", status_code=204, responses=errors(401, 403, 404, 409))
async def disconnect_identity(identity_id: str, request: Request, user: CurrentUser, ctx: Ctx,
                              session: SessionDep) -> Response:
    """Unlink an identity; refused (409) where the account would be left with no way to sign in."""
    _signed_in_person(request)
    account = await session.get(User, user.id)
    row = await disconnect(session, account, identity_id, ctx.settings.sso)
    await session.commit()
    ctx.callers.forget_user(user.id)
    if ctx.audit is not None:
        await ctx.audit.record("auth.sso_unlinked", request=request, actor_id=user.id, actor_name=user.username,
                               target=row.id, detail={"issuer": row.issuer})
    return Response(status_code=204)


@router.get("/callback", name="sso_callback", response_class=RedirectResponse, status_code=302,
            responses=REDIRECT | errors(400, 403, 404, 409, 502))
async def sso_callback(request: Request, ctx: Ctx, session: SessionDep,
                       code: str | None = Query(None, max_length=2048), state: str | None = Query(None, max_length=512),
                       error: str | None = Query(None, max_length=200),
                       error_description: str | None = Query(None, max_length=1000)) -> RedirectResponse:
    """Where the provider sends the browser back: verify, then sign in to the linked (or a new) account and
    go to the app with a session token, or, for a connecting flow, link the identity to its account."""
    cookie = request.cookies.get(COOKIE)
    link_to = None
    try:
        client = _client(request, ctx)
        link_to = client.link_of(cookie)
        if error:
            raise refused(f"the provider said {error}" + (f": {error_description}" if error_description else ""))
        if not code or not state:
            raise refused("the callback needs the provider's code and state")
        who = await client.finish(code, state, cookie)
        if link_to is not None:
            user = await _connecting_account(session, link_to)
            await connect(session, user, who, ctx.settings.sso)
        else:
            user = await account_for(session, who, ctx.settings.sso)
        await session.commit()
    except ApiError as failure:
        if _browser(request):
            await session.rollback()
            return _back_to_login(failure, connecting=link_to is not None)
        raise
    ctx.callers.forget_user(user.id)  # a role changed by the claim applies at once
    if ctx.audit is not None:
        await ctx.audit.record("auth.sso_linked" if link_to else "auth.sso_login", request=request,
                               actor_id=user.id, actor_name=user.username,
                               detail={"issuer": who.issuer} if getattr(who, "issuer", None) else {})
    if link_to is not None:
        response = RedirectResponse("/#sso_linked=1", status_code=302)
    else:
        token = ctx.tokens.issue(user.id, user.session_version or 0)
        response = RedirectResponse(f"/#sso_token={token}", status_code=302)
    response.delete_cookie(COOKIE, path=COOKIE_PATH)
    return response


async def _connecting_account(session: AsyncSession, link_to: LinkTo) -> User:
    """The account the flow began from, as long as that session was not signed out everywhere meanwhile."""
    user = await session.get(User, link_to.user_id)
    if user is None or (user.session_version or 0) != link_to.session_version:
        raise refused("the account that began connecting was signed out or deleted meanwhile; sign in and "
                      "start again")
    return user
