"""One error shape for every route, OpenAI's: {"error": {"message", "type", "param", "code"}};
except on the Anthropic Messages API (/v1/messages...), whose clients expect Anthropic's:
{"type": "error", "error": {"type", "message"}}, with a refusal by the admission queue (a 503 elsewhere)
sent as 529 overloaded_error.

Every room raises `ApiError` (status, message, code, param) for a refusal the caller can act on;
api/error_handlers.py turns it, and every other failure, into an answer in this shape.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from chatloom.serving import BadGenerationRequest

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
