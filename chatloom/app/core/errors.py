"""One error shape for every route, OpenAI's: {"error": {"message", "type", "param", "code"}};
except on the Anthropic Messages API (/v1/messages...), whose clients expect Anthropic's:
{"type": "error", "error": {"type", "message"}}, with a refusal by the admission queue (a 503 elsewhere)
sent as 529 overloaded_error.

Handlers turn validation failures, unknown routes and backend refusals into 4xx answers
that name the problem; anything unexpected is logged and becomes a 500 in the same shape.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatloom.serving import BackendError, BackendNotReady, BadGenerationRequest, UnknownModel

log = logging.getLogger(__name__)

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
         413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
         503: "service_unavailable", 500: "server_error", 502: "server_error"}


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's status for "busy, retry later"
QUEUE_REFUSALS = ("queue_full", "queue_timeout")  # the admission queue's codes (traffic/admission.py)
ANTHROPIC_PREFIX = "/v1/messages"


class ErrorDetail(BaseModel):
    message: str = Field(description="what went wrong, in words meant for the person who sent the request")
    type: str = Field(description="the class of error, as OpenAI names them (invalid_request_error, ...)")
    param: str | None = Field(description="the field, parameter or header at fault, when one is")
    code: str | None = Field(description="a stable machine-readable code (queue_full, invalid_text, ...)")


class ErrorOut(BaseModel):
    """The body of every error answer (what error_body builds); the OpenAPI schema declares it."""

    error: ErrorDetail


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def anthropic_status(status: int, code: str | None) -> int:
    """The status Anthropic's API would send: 529 when the admission queue refused."""
    return OVERLOADED if status == 503 and code in QUEUE_REFUSALS else status


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error object (also the data of a stream's `error` event); `status` as anthropic_status
    gives it. Other client errors are invalid_request_error, other server errors api_error."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error answer in the shape the API at `path` uses."""
    if is_anthropic_path(path):
        status = anthropic_status(status, code)
        return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def error_event(exc: Exception) -> dict:
    """A failure as an SSE error event of the conversation stream: the same shape as an HTTP error's
    body plus its status (and retry_after where the refusal has one)."""
    status = exc.status if isinstance(exc, ApiError) else 400 if isinstance(exc, BadGenerationRequest) else 500
    message = str(exc) if status < 500 or isinstance(exc, ApiError) else f"generation failed: {exc}"
    code = exc.code if isinstance(exc, (ApiError, BadGenerationRequest)) else "generation_failed"
    body = {"message": message, "type": TYPES.get(status, "server_error"), "code": code, "status": status}
    event: dict = {"error": body}
    headers = exc.headers if isinstance(exc, ApiError) else None
    if headers and "Retry-After" in headers:
        event["retry_after"] = int(headers["Retry-After"])
    return event


def not_found(what: str = "conversation") -> ApiError:
    return ApiError(404, f"{what} not found", f"{what.replace(' ', '_')}_not_found")


def _is_openai(request: Request) -> bool:
    return is_openai_path(request.url.path)


def is_openai_path(path: str) -> bool:
    """The OpenAI-compatible API, whose request validation errors are 400 (the product API's are 422)."""
    return path.startswith("/v1/")


def _describe(errors: list[dict]) -> tuple[str, str | None, str]:
    """A readable message for FastAPI's validation errors, the offending field, and a code."""
    parts = []
    param = None
    code = "invalid_value"
    for err in errors[:5]:
        raw_loc = list(err.get("loc", ()))
        loc = [str(x) for x in raw_loc[1:]] if raw_loc and raw_loc[0] in ("body", "query", "path", "header") \
            else [str(x) for x in raw_loc]
        if err.get("type") == "json_invalid":
            return "request body is not valid JSON", None, "invalid_json"
        if err.get("type") == "missing":
            code = "missing_field" if code == "invalid_value" else code
        field = ".".join(loc)
        param = param or field or None
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        where = field or ("request body" if raw_loc[:1] == ["body"] else "")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request", param, code


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _describe(list(exc.errors()))
        # OpenAI answers malformed requests with 400; the product API uses 422 for well-formed but wrong bodies.
        status = 400 if code == "invalid_json" or _is_openai(request) else 422
        return error_response(status, message, code, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, message, code, headers=getattr(exc, "headers", None),
                              path=request.url.path)

    @app.exception_handler(UnknownModel)
    async def _unknown_model(request: Request, exc: UnknownModel) -> JSONResponse:
        return error_response(404 if _is_openai(request) else 400, str(exc), exc.code, exc.param,
                              path=request.url.path)

    @app.exception_handler(BadGenerationRequest)
    async def _bad_generation(request: Request, exc: BadGenerationRequest) -> JSONResponse:
        return error_response(400, str(exc), exc.code, exc.param, path=request.url.path)

    @app.exception_handler(BackendNotReady)
    async def _not_ready(request: Request, exc: BackendNotReady) -> JSONResponse:
        return error_response(503, str(exc), "model_not_ready", headers={"Retry-After": "5"}, path=request.url.path)

    @app.exception_handler(BackendError)
    async def _backend(request: Request, exc: BackendError) -> JSONResponse:
        log.error("backend failure: %s", exc)
        return error_response(502, f"the model backend failed: {exc}", "backend_error", path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal error", "internal_error", path=request.url.path)
