"""Single sign-on with OpenID Connect: what the login screen offers, leaving for the provider, and the
callback that signs the browser in. The session token reaches the browser app in the URL fragment of the
final redirect (/#sso_token=...), which browsers never send to a server or in a Referer. A browser whose
sign-in fails goes back to the login screen with the reason (/#sso_error=...) rather than to a page of
JSON; other clients get the JSON error."""
from __future__ import annotations

from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse

from chatloom.app.api.account_schemas import SsoInfo
from chatloom.app.api.deps import AppContext, Ctx, SessionDep
from chatloom.app.api.openapi_responses import errors
from chatloom.app.core.errors import ApiError
from chatloom.app.core.oidc import OidcClient, refused
from chatloom.app.core.sso_accounts import account_for

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


def _back_to_login(error: ApiError) -> RedirectResponse:
    response = RedirectResponse("/#" + urlencode({"sso_error": error.message}), status_code=302)
    response.delete_cookie(COOKIE, path=COOKIE_PATH)
    return response


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
    response.set_cookie(COOKIE, sign_in.state_cookie, max_age=ctx.settings.sso.state_ttl_s, path=COOKIE_PATH,
                        httponly=True, samesite="lax", secure=request.url.scheme == "https")
    return response


@router.get("/callback", name="sso_callback", response_class=RedirectResponse, status_code=302,
            responses=REDIRECT | errors(400, 403, 404, 502))
async def sso_callback(request: Request, ctx: Ctx, session: SessionDep,
                       code: str | None = Query(None, max_length=2048), state: str | None = Query(None, max_length=512),
                       error: str | None = Query(None, max_length=200),
                       error_description: str | None = Query(None, max_length=1000)) -> RedirectResponse:
    """Where the provider sends the browser back: verify, sign in to the linked (or a new) account, and
    go to the app with a session token."""
    try:
        client = _client(request, ctx)
        if error:
            raise refused(f"the provider said {error}" + (f": {error_description}" if error_description else ""))
        if not code or not state:
            raise refused("the callback needs the provider's code and state")
        who = await client.finish(code, state, request.cookies.get(COOKIE))
        user = await account_for(session, who, ctx.settings.sso)
        await session.commit()
    except ApiError as failure:
        if _browser(request):
            await session.rollback()
            return _back_to_login(failure)
        raise
    ctx.callers.forget_user(user.id)  # a role changed by the claim applies at once
    if ctx.audit is not None:
        await ctx.audit.record("auth.sso_login", request=request, actor_id=user.id, actor_name=user.username,
                               detail={"issuer": who.issuer} if getattr(who, "issuer", None) else {})
    token = ctx.tokens.issue(user.id, user.session_version or 0)
    response = RedirectResponse(f"/#sso_token={token}", status_code=302)
    response.delete_cookie(COOKIE, path=COOKIE_PATH)
    return response
