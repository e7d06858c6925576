"""The HTTP face of errors: handlers that turn validation failures, unknown routes and backend
refusals into 4xx answers in the one error shape (core/errors.py), naming the problem; anything
unexpected is logged and becomes a 500 in the same shape. Request validation follows each API's
habit: 400 on the OpenAI-compatible API, 422 on the product API.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatloom.app.core.errors import ApiError, error_response
from chatloom.serving import BackendError, BackendNotReady, BadGenerationRequest, UnknownModel
from chatloom.store.blobs import StorageFull

log = logging.getLogger(__name__)


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


# asyncpg's errors for a server that is going down, starting up or gone.
_PG_UNREACHABLE = {"AdminShutdownError", "CannotConnectNowError", "ConnectionDoesNotExistError",
                   "ConnectionFailureError", "TooManyConnectionsError"}


def database_unreachable(exc: BaseException) -> bool:
    """The database (not the request) is the problem: it refused or lost the connection, or is restarting."""
    if isinstance(exc, ConnectionError):
        return True
    if not isinstance(exc, DBAPIError):
        return False
    orig = getattr(exc, "orig", None)
    names = {type(orig).__name__, type(getattr(orig, "__cause__", None)).__name__}
    return exc.connection_invalidated or isinstance(exc, (OperationalError, InterfaceError)) or bool(names & _PG_UNREACHABLE)


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

    @app.exception_handler(ConnectionError)  # asyncpg's connect refused or reset reaches here unwrapped
    @app.exception_handler(DBAPIError)
    async def _database(request: Request, exc: Exception) -> JSONResponse:
        if not database_unreachable(exc):
            log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
            return error_response(500, "internal error", "internal_error", path=request.url.path)
        log.error("database unreachable on %s %s: %s", request.method, request.url.path, exc)
        return error_response(503, "the database is unreachable (restarting?); retry shortly", "database_unavailable",
                              headers={"Retry-After": "2"}, path=request.url.path)

    @app.exception_handler(StorageFull)
    async def _storage_full(request: Request, exc: StorageFull) -> JSONResponse:
        # The disk fills and empties while the service runs: a dependency down, not a broken request.
        log.error("upload refused: %s", exc.strerror)
        return error_response(503, "the server's file storage is full; nothing was stored, retry later",
                              "storage_full", headers={"Retry-After": "30"}, path=request.url.path)

    @app.exception_handler(BackendError)
    async def _backend(request: Request, exc: BackendError) -> JSONResponse:
        log.error("backend failure: %s", exc)
        return error_response(502, f"the model backend failed: {exc}", "backend_error", path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal error", "internal_error", path=request.url.path)
