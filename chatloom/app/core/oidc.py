"""OpenID Connect sign-in (authorization code with PKCE) against one identity provider, with authlib.

Pure protocol, no FastAPI and no database: the provider's metadata and keys (read from its discovery
document and cached), the authorization URL and the sign-in's state (a short signed cookie, so any
gateway of a fleet can finish a sign-in another began), the code exchange, and the ID token's
verification (signature by the provider's JWKS; issuer, audience, expiry and nonce). What an account
becomes of the verified claims is api/routes/sso.py's and chat's business.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import jwt as pyjwt
from authlib.common.security import generate_token
from authlib.integrations.base_client import OAuthError
from authlib.integrations.httpx_client import AsyncOAuth2Client
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from chatloom.app.core.errors import ApiError

STATE_ALGORITHM = "HS256"
STATE_PURPOSE = "sso-state"
METADATA_TTL_S = 3600.0
HTTP_TIMEOUT_S = 10.0
CLOCK_LEEWAY_S = 60


@dataclass(frozen=True)
class SignIn:
    """A sign-in on its way to the provider: where to send the browser, and the cookie to set."""

    url: str
    state_cookie: str


@dataclass(frozen=True)
class LinkTo:
    """A flow begun from a signed-in account to connect an identity to it: the account, and its session
    version then (signing out everywhere meanwhile ends the flow)."""

    user_id: str
    session_version: int


@dataclass(frozen=True)
class Identity:
    """The verified person: the ID token's claims, with the userinfo endpoint's where it has one."""

    issuer: str
    subject: str
    email: str | None
    email_verified: bool
    claims: dict[str, Any]

    def values(self, claim: str | None) -> list[str]:
        """A claim as a list of strings (a string claim is one value; a list keeps its strings)."""
        value = self.claims.get(claim) if claim else None
        if isinstance(value, str):
            return [value]
        if isinstance(value, list):
            return [v for v in value if isinstance(v, str)]
        return []


def provider_error(what: str) -> ApiError:
    return ApiError(502, f"the identity provider failed: {what}", "sso_provider_error")


def refused(what: str) -> ApiError:
    return ApiError(400, f"single sign-on failed: {what}", "sso_failed")


class OidcClient:
    """One provider, as configured: issuer, client id and secret, scopes."""

    def __init__(self, issuer: str, client_id: str, client_secret: str | None, scopes: str, secret: str,
                 state_ttl_s: int) -> None:
        self.issuer = issuer.rstrip("/")
        self.client_id = client_id
        self.client_secret = client_secret
        self.scopes = scopes
        self._secret = secret  # signs the state cookie
        self.state_ttl_s = state_ttl_s
        self._metadata: dict[str, Any] | None = None
        self._metadata_at = 0.0
        self._keys: KeySet | None = None
        self._lock = asyncio.Lock()

    # -- the provider's metadata and keys -----------------------------------------------------------
    async def _get_json(self, url: str) -> dict[str, Any]:
        try:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
                r = await http.get(url)
        except httpx.HTTPError as exc:
            raise provider_error(f"{url} is out of reach ({exc.__class__.__name__})") from None
        if r.status_code != 200:
            raise provider_error(f"{url} answered {r.status_code}")
        try:
            data = r.json()
        except ValueError:
            raise provider_error(f"{url} did not answer JSON") from None
        if not isinstance(data, dict):
            raise provider_error(f"{url} did not answer a JSON object")
        return data

    async def metadata(self) -> dict[str, Any]:
        async with self._lock:
            if self._metadata is None or time.monotonic() - self._metadata_at > METADATA_TTL_S:
                data = await self._get_json(self.issuer + "/.well-known/openid-configuration")
                missing = [k for k in ("authorization_endpoint", "token_endpoint", "jwks_uri") if not data.get(k)]
                if missing:
                    raise provider_error(f"its discovery document lacks {', '.join(missing)}")
                if str(data.get("issuer", "")).rstrip("/") != self.issuer:
                    raise provider_error(f"its discovery document names the issuer {data.get('issuer')!r}, "
                                         f"not {self.issuer!r}")
                self._metadata, self._metadata_at, self._keys = data, time.monotonic(), None
            return self._metadata

    async def keys(self, refresh: bool = False) -> KeySet:
        meta = await self.metadata()
        if self._keys is None or refresh:
            try:
                self._keys = KeySet.import_key_set(await self._get_json(meta["jwks_uri"]))
            except (JoseError, ValueError, TypeError, KeyError) as exc:
                raise provider_error(f"its JWKS cannot be read ({exc})") from None
        return self._keys

    # -- leaving for the provider -------------------------------------------------------------------
    def _client(self, redirect_uri: str) -> AsyncOAuth2Client:
        return AsyncOAuth2Client(self.client_id, self.client_secret, scope=self.scopes, redirect_uri=redirect_uri,
                                 code_challenge_method="S256", timeout=HTTP_TIMEOUT_S,
                                 token_endpoint_auth_method="client_secret_basic" if self.client_secret else "none")

    async def begin(self, redirect_uri: str, link_to: LinkTo | None = None) -> SignIn:
        meta = await self.metadata()
        state, nonce, verifier = generate_token(32), generate_token(32), generate_token(64)
        async with self._client(redirect_uri) as client:
            url, _ = client.create_authorization_url(meta["authorization_endpoint"], state=state,
                                                     code_verifier=verifier, nonce=nonce)
        now = int(time.time())
        pending = {"purpose": STATE_PURPOSE, "state": state, "nonce": nonce, "verifier": verifier,
                   "redirect_uri": redirect_uri, "iat": now, "exp": now + self.state_ttl_s}
        if link_to is not None:  # signed with the rest, so the callback cannot be pointed at another account
            pending["link_user"], pending["link_version"] = link_to.user_id, link_to.session_version
        return SignIn(url, pyjwt.encode(pending, self._secret, STATE_ALGORITHM))

    def link_of(self, cookie: str | None) -> LinkTo | None:
        """The account a validly signed state cookie connects to; None for a sign-in or an unreadable cookie.
        Expiry is not checked here: finish() refuses an expired cookie, and an expired connecting flow's
        error should still go back to the settings rather than to the login screen."""
        if not cookie:
            return None
        try:
            pending = pyjwt.decode(cookie, self._secret, algorithms=[STATE_ALGORITHM],
                                   options={"verify_exp": False})
        except pyjwt.PyJWTError:
            return None
        user, version = pending.get("link_user"), pending.get("link_version")
        if pending.get("purpose") != STATE_PURPOSE or not isinstance(user, str) or not isinstance(version, int):
            return None
        return LinkTo(user, version)

    # -- coming back ----------------------------------------------------------------------------------
    def _pending(self, cookie: str | None, state: str) -> dict[str, Any]:
        if not cookie:
            raise refused("no sign-in is under way in this browser (its cookie is missing); start again")
        try:
            pending = pyjwt.decode(cookie, self._secret, algorithms=[STATE_ALGORITHM],
                                   options={"require": ["exp", "state", "nonce", "verifier"]})
        except pyjwt.ExpiredSignatureError:
            raise refused("the sign-in took too long; start again") from None
        except pyjwt.PyJWTError:
            raise refused("the sign-in's cookie is not valid; start again") from None
        if pending.get("purpose") != STATE_PURPOSE or pending["state"] != state:
            raise refused("the state does not match this browser's sign-in; start again")
        return pending

    async def finish(self, code: str, state: str, cookie: str | None) -> Identity:
        """Exchange the code (with the PKCE verifier) and verify the ID token that comes back."""
        pending = self._pending(cookie, state)
        meta = await self.metadata()
        async with self._client(pending["redirect_uri"]) as client:
            try:
                token = await client.fetch_token(meta["token_endpoint"], grant_type="authorization_code", code=code,
                                                 code_verifier=pending["verifier"])
            except OAuthError as exc:  # the provider's refusal (an expired or used code, a wrong secret)
                raise refused(f"the provider would not exchange the code ({exc})") from None
            except Exception as exc:  # out of reach, or a 5xx: httpx's errors, raised through authlib's client
                raise provider_error(f"its token endpoint failed ({exc.__class__.__name__}: {exc})") from None
            if not isinstance(token.get("id_token"), str):
                raise refused("the provider sent no ID token (is 'openid' among the scopes?)")
            claims = await self._verify(token["id_token"], pending["nonce"])
            if meta.get("userinfo_endpoint") and token.get("access_token"):
                claims = {**await self._userinfo(client, meta["userinfo_endpoint"], claims["sub"]), **claims}
        email = claims.get("email")
        return Identity(self.issuer, str(claims["sub"]), email.strip().lower() if isinstance(email, str) else None,
                        claims.get("email_verified") is True, claims)

    async def _verify(self, id_token: str, nonce: str) -> dict[str, Any]:
        keys = await self.keys()
        try:
            try:
                decoded = jwt.decode(id_token, keys)
            except JoseError:  # the provider may have rotated its keys since they were fetched
                decoded = jwt.decode(id_token, await self.keys(refresh=True))
            jwt.JWTClaimsRegistry(leeway=CLOCK_LEEWAY_S, iss={"essential": True, "values": [self.issuer,
                                                                                            self.issuer + "/"]},
                                  aud={"essential": True, "value": self.client_id}, sub={"essential": True},
                                  exp={"essential": True}, nonce={"essential": True, "value": nonce}
                                  ).validate(decoded.claims)
        except (JoseError, ValueError) as exc:
            raise refused(f"the ID token failed verification ({exc})") from None
        return dict(decoded.claims)

    async def _userinfo(self, client: AsyncOAuth2Client, url: str, subject: str) -> dict[str, Any]:
        try:
            r = await client.get(url)
            info = r.json() if r.status_code == 200 else {}
        except Exception:  # userinfo only adds claims; the verified ID token is enough to sign in
            return {}
        # Claims about someone else must not be merged (OpenID Connect Core 5.3.2).
        return info if isinstance(info, dict) and info.get("sub") == subject else {}
