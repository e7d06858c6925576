"""Security headers on every response, and cross-origin access only for the origins the settings name.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware), so streamed answers pass through untouched
apart from their first message's headers. Routes that set a header themselves (the browser app's own
Content-Security-Policy, a download's disposition) keep theirs."""
from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatloom.settings import Settings

# API answers are data, never pages to frame or sniff; the app's pages set a stricter policy of their own.
BASE_HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
    "content-security-policy": "default-src 'none'; frame-ancestors 'none'",
}


class SecurityHeaders:
    def __init__(self, app: ASGIApp, hsts_max_age_s: int) -> None:
        self.app = app
        self.hsts = f"max-age={hsts_max_age_s}; includeSubDomains" if hsts_max_age_s else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        https = scope.get("scheme") == "https"
        # FastAPI's interactive API pages load their own scripts and styles.
        skip_csp = scope.get("path", "").startswith(("/docs", "/redoc"))

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                for name, value in BASE_HEADERS.items():
                    if name.encode() not in present and not (skip_csp and name == "content-security-policy"):
                        headers.append((name.encode(), value.encode()))
                if https and self.hsts and b"strict-transport-security" not in present:
                    headers.append((b"strict-transport-security", self.hsts.encode()))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)


def install_security_headers(app: FastAPI, settings: Settings) -> None:
    """Add both middlewares (call after the others: the last added runs first, so these see every answer)."""
    app.add_middleware(SecurityHeaders, hsts_max_age_s=settings.server.hsts_max_age_s)
    if settings.server.cors_origins:
        # Bearer tokens, not cookies, authenticate the API: no credentials mode is needed.
        app.add_middleware(CORSMiddleware, allow_origins=settings.server.cors_origins, allow_credentials=False,
                           allow_methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                           allow_headers=["authorization", "content-type", "x-api-key", "last-event-id",
                                          "openai-beta", "anthropic-version"],
                           expose_headers=["retry-after", "x-request-id", "x-ratelimit-limit-tokens",
                                           "x-ratelimit-remaining-tokens", "x-chatloom-degraded"], max_age=600)
