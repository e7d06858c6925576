"""An OpenID Connect provider for tests, built on authlib's server side and served on loopback:
discovery, authorization (it signs in `provider.user` at once, as if the person had typed a password),
token (authorization code with PKCE; the ID token signed RS256) and JWKS endpoints.

(A uniquely named module: pytest puts this folder on sys.path, so test modules import it directly.)"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from authlib.oauth2 import AuthorizationServer
from authlib.oauth2.rfc6749 import OAuth2Request
from authlib.oauth2.rfc6749.grants import AuthorizationCodeGrant
from authlib.oauth2.rfc6749.requests import BasicOAuth2Payload, JsonRequest
from authlib.oauth2.rfc6750 import BearerTokenGenerator
from authlib.oauth2.rfc7636 import CodeChallenge
from authlib.oidc.core import UserInfo
from authlib.oidc.core.grants import OpenIDCode
from joserfc.jwk import KeySet, RSAKey
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

CLIENT_ID = "chatloom-test"
CLIENT_SECRET = "test-client-secret"


class FormRequest(OAuth2Request):
    """An OAuth2Request from the query string and the form, read beforehand (authlib's server is synchronous)."""

    def __init__(self, method: str, uri: str, headers, query: dict, form: dict) -> None:
        super().__init__(method, uri, headers=headers)
        self._args, self._form = query, form
        self.payload = BasicOAuth2Payload({**query, **form})

    @property
    def args(self):
        return self._args

    @property
    def form(self):
        return self._form


@dataclass
class Person:
    sub: str
    email: str
    email_verified: bool = True
    preferred_username: str = "carol"
    groups: list[str] = field(default_factory=list)


@dataclass
class Client:
    client_id: str
    client_secret: str
    redirect_uri: str

    def get_client_id(self): return self.client_id
    def get_default_redirect_uri(self): return self.redirect_uri
    def get_allowed_scope(self, scope): return " ".join(s for s in scope.split() if s in ("openid", "email", "profile", "groups"))
    def check_redirect_uri(self, redirect_uri): return redirect_uri == self.redirect_uri
    def check_client_secret(self, client_secret): return client_secret == self.client_secret
    def check_endpoint_auth_method(self, method, endpoint): return method in ("client_secret_basic", "none")
    def check_response_type(self, response_type): return response_type == "code"
    def check_grant_type(self, grant_type): return grant_type == "authorization_code"


@dataclass
class Code:
    code: str
    client_id: str
    redirect_uri: str
    scope: str
    user: Person
    nonce: str | None
    code_challenge: str | None
    code_challenge_method: str | None
    auth_time: int = field(default_factory=lambda: int(time.time()))

    def get_redirect_uri(self): return self.redirect_uri
    def get_scope(self): return self.scope
    def get_nonce(self): return self.nonce
    def get_auth_time(self): return self.auth_time
    def get_acr(self): return None
    def get_amr(self): return None


class Provider:
    """The provider's state: its key, its one client, the codes it issued, who is 'signed in' there."""

    def __init__(self) -> None:
        self.issuer = ""  # set once its port is known
        self.key = RSAKey.generate_key(2048, parameters={"kid": "test-key", "use": "sig", "alg": "RS256"})
        self.client: Client | None = None
        self.codes: dict[str, Code] = {}
        self.user = Person("person-1", "carol@example.com")
        self.token_requests = 0
        self.server = self._server()

    def _server(self) -> AuthorizationServer:
        provider = self

        class Grant(AuthorizationCodeGrant):
            TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "none"]

            def save_authorization_code(self, code, request):
                data = request.payload.data
                provider.codes[code] = Code(code, request.client.client_id, data.get("redirect_uri"), request.scope,
                                            request.user, data.get("nonce"), data.get("code_challenge"),
                                            data.get("code_challenge_method"))

            def query_authorization_code(self, code, client):
                item = provider.codes.get(code)
                return item if item and item.client_id == client.client_id else None

            def delete_authorization_code(self, authorization_code):
                provider.codes.pop(authorization_code.code, None)

            def authenticate_user(self, authorization_code):
                return authorization_code.user

        class Oidc(OpenIDCode):
            def exists_nonce(self, nonce, request):
                return any(c.nonce == nonce for c in provider.codes.values())

            def resolve_client_private_key(self, client):
                return provider.key

            def get_client_claims(self, client):
                return {"iss": provider.issuer, "aud": [client.get_client_id()]}

            def get_client_algorithm(self, client):
                return "RS256"

            def get_encode_header(self, client):
                return {"alg": "RS256", "kid": "test-key"}

            def generate_user_info(self, user, scope):
                info = UserInfo(sub=user.sub, preferred_username=user.preferred_username, groups=user.groups)
                if "email" in scope:
                    info["email"], info["email_verified"] = user.email, user.email_verified
                return info

        class Server(AuthorizationServer):
            def query_client(self, client_id):
                return provider.client if provider.client and provider.client.client_id == client_id else None

            def save_token(self, token, request):
                pass

            def send_signal(self, name, *args, **kwargs):
                pass

            def create_oauth2_request(self, request):
                return request  # built by the routes below from the Starlette request

            def create_json_request(self, request):
                return JsonRequest(request.method, request.uri, request.headers)

            def handle_response(self, status, body, headers):
                body = json.dumps(body) if isinstance(body, dict) else body
                return Response(body, status_code=status, headers=dict(headers))

        server = Server(scopes_supported=["openid", "email", "profile", "groups"])
        server.register_token_generator("default", BearerTokenGenerator(lambda *a, **k: "at-" + str(time.time_ns())))
        server.register_grant(Grant, [CodeChallenge(required=True), Oidc(require_nonce=True)])
        return server

    def app(self) -> Starlette:
        async def oauth_request(request: Request) -> OAuth2Request:
            query = dict(parse_qsl(urlsplit(str(request.url)).query))
            form = dict(parse_qsl((await request.body()).decode())) if request.method == "POST" else {}
            # Starlette's headers are case-insensitive, as authlib's lookups of "Authorization" expect.
            return FormRequest(request.method, str(request.url), request.headers, query, form)

        async def discovery(request: Request) -> JSONResponse:
            return JSONResponse({"issuer": self.issuer, "authorization_endpoint": self.issuer + "/authorize",
                                 "token_endpoint": self.issuer + "/token", "jwks_uri": self.issuer + "/jwks",
                                 "response_types_supported": ["code"], "subject_types_supported": ["public"],
                                 "id_token_signing_alg_values_supported": ["RS256"],
                                 "code_challenge_methods_supported": ["S256"]})

        async def jwks(request: Request) -> JSONResponse:
            return JSONResponse(KeySet([self.key]).as_dict(private=False))

        async def authorize(request: Request) -> Response:
            req = await oauth_request(request)
            grant = self.server.get_consent_grant(req, end_user=self.user)
            return self.server.create_authorization_response(req, grant_user=self.user, grant=grant)

        async def token(request: Request) -> Response:
            self.token_requests += 1
            return self.server.create_token_response(await oauth_request(request))

        return Starlette(routes=[Route("/.well-known/openid-configuration", discovery), Route("/jwks", jwks),
                                 Route("/authorize", authorize), Route("/token", token, methods=["POST"])])
