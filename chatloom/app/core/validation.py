"""Validation at the edge, in one place: what no route should ever have to see.

- A body larger than `max_body_bytes` is answered 413 before anything parses it (Content-Length
  checked first, then the bytes as they arrive, for chunked uploads).
- Text that cannot be stored or tokenized is refused with 400 naming the field: lone UTF-16
  surrogates (a JSON "\\ud800" escape decodes to one; tokenizers and databases reject it) and
  control characters other than tab, newline and carriage return, anywhere in a JSON body, the
  path or the query string.
- Numbers the store cannot hold (pagination offsets beyond the database's 64-bit integers) and
  seeds beyond signed 64 bits are bounded by the types below, so they are 4xx, never a 500.
- Requests that can never be served (a prompt leaving no room in the context window, or needing
  more than the whole KV pool) are a 400, checked before quotas and the queue, so they are never a 429 or 503.
- Large inputs are tokenized and moderated in a worker thread (`off_loop`), so one huge message
  does not stall every other user's stream on the event loop.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any, Callable, TypeVar
from urllib.parse import unquote

from fastapi import Query
from pydantic import Field

from chatloom.app.core.errors import ApiError, error_response
from chatloom.engine.sampling_params import SEED_MAX, SEED_MIN

T = TypeVar("T")

INT64_MAX = 2 ** 63 - 1
# Pagination: beyond this an OFFSET overflows SQLite's and PostgreSQL's 64-bit integers.
Offset = Annotated[int, Query(ge=0, le=INT64_MAX, description="rows to skip (0 to 2^63-1)")]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX, description="a signed 64-bit integer")]

# Inputs longer than this are tokenized and moderated off the event loop (about 10 ms of work).
LARGE_INPUT_CHARS = 16_000
# JSON bodies larger than this are parsed for the text check off the event loop too.
LARGE_BODY_BYTES = 64 * 1024

# Lone surrogates, C0 controls except \t \n \r, DEL.
_BAD_CHAR = re.compile("[\ud800-\udfff\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def bad_text(text: str) -> str | None:
    """Why `text` cannot be accepted, or None."""
    m = _BAD_CHAR.search(text)
    if m is None:
        return None
    ch = m.group()
    what = "a lone surrogate" if "\ud800" <= ch <= "\udfff" else "a control character"
    return f"contains {what} (U+{ord(ch):04X}) at position {m.start()}; send valid Unicode text"


def _path(parent: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def find_bad_text(value: Any, where: str = "") -> tuple[str, str] | None:
    """The first (field path, problem) of a parsed JSON value, or None when every string is clean."""
    stack = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            problem = bad_text(v)
            if problem:
                return path or "body", problem
        elif isinstance(v, dict):
            items = list(v.items())
            for k, item in reversed(items):
                problem = bad_text(k)
                if problem:
                    return _path(path, k), f"field name {problem}"
                stack.append((_path(path, k), item))
        elif isinstance(v, list):
            stack.extend((_path(path, i), item) for i, item in reversed(list(enumerate(v))))
    return None


def scan_json_body(body: bytes) -> tuple[str, str] | None:
    """The first bad string of a JSON body; None for clean or non-JSON bodies (the route reports those)."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return find_bad_text(parsed)


def check_fits(prompt_tokens: int, max_tokens: int, context_window: int, pool_tokens: int | None,
               param: str = "messages", choices: int = 1) -> None:
    """Refuse (400) a request no amount of waiting would let run: a prompt that leaves no room in the
    context window for an answer, or one whose prompt plus answer (at most the window; the engine
    stops answers there) needs more KV cache than the engine's whole pool; with several `choices`,
    the prompt once and each choice's answer.
    The same limits the engine enforces, checked before quotas and the queue see the request."""
    if prompt_tokens >= context_window:
        raise ApiError(400, f"the prompt has {prompt_tokens} tokens; the context window is {context_window} "
                       "tokens and the answer needs room too; shorten the messages", "context_length_exceeded",
                       param)
    need = min(prompt_tokens + max_tokens, context_window)
    need += (choices - 1) * (need - prompt_tokens)
    if pool_tokens is not None and need > pool_tokens:
        raise ApiError(400, f"this request needs up to {need} tokens of KV cache; the server's whole pool "
                       f"holds {pool_tokens}; shorten the messages or lower max_tokens", "context_length_exceeded",
                       param)


async def off_loop(fn: Callable[..., T], *args: Any, size: int) -> T:
    """fn(*args), in a worker thread when the input is large (`size` characters), inline otherwise."""
    if size >= LARGE_INPUT_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class EdgeGuard:
    """ASGI middleware: the body size limit and the text check, before any route runs.
    (Pure ASGI, so streamed answers pass through unbuffered.)

    `larger_bodies` maps the exact paths of routes that take a file to a limit of their own; their bodies
    are read here but get no text check, since a file may hold any text (a model's answer with a control
    character): such a route checks what it reads. `uploads` maps the paths that take file uploads (multipart) to their own limit: their
    bodies are not read here (the route streams them to disk and checks its own limits), only a declared
    Content-Length over that limit is refused."""

    def __init__(self, app, max_body_bytes: int = 1_000_000, larger_bodies: dict[str, int] | None = None,
                 uploads: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.larger_bodies = dict(larger_bodies or {})
        self.uploads = dict(uploads or {})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        problem = _bad_target(scope)
        if problem is not None:
            return await _reply(scope, send, 400, *problem)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        upload = self.uploads.get(path) if scope.get("method") == "POST" else None
        limit = upload or self.larger_bodies.get(path, self.max_body_bytes)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await _reply(scope, send, 400, "Content-Length is not a number", "header", "invalid_header")
            if declared > limit:
                return await _reply(scope, send, 413, *self._too_large(declared, limit))
        elif b"transfer-encoding" not in headers:
            return await self.app(scope, receive, send)  # no body at all
        if upload is not None:
            return await self.app(scope, receive, send)  # an upload: the route streams it to disk

        # Read the body (bounded), check it, then hand it to the route as if it came from the client.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _reply(scope, send, 413, *self._too_large(size, limit))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        ctype = headers.get(b"content-type", b"").lower()
        if body and not ctype.startswith((b"multipart/", b"application/x-www-form-urlencoded")) \
                and path not in self.larger_bodies:
            found = (await asyncio.to_thread(scan_json_body, body) if len(body) > LARGE_BODY_BYTES
                     else scan_json_body(body))
            if found is not None:
                field, why = found
                return await _reply(scope, send, 400, f"{field}: {why}", field, "invalid_text")

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as streaming responses expect

        await self.app(scope, replay, send)

    @staticmethod
    def _too_large(size: int, limit: int) -> tuple[str, str | None, str]:
        return (f"the request body is {size} bytes; at most {limit} are accepted", None, "request_too_large")


def _bad_target(scope) -> tuple[str, str, str] | None:
    """A bad character in the decoded path or query string."""
    path = scope.get("path", "")
    problem = bad_text(path)
    if problem:
        return f"the URL path {problem}", "path", "invalid_text"
    query = scope.get("query_string", b"").decode("latin-1")
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        for part in (name, value):
            problem = bad_text(unquote(part.replace("+", " "), errors="surrogateescape"))
            if problem:
                field = unquote(name) or "query"
                return f"{field}: {problem}", field, "invalid_text"
    return None


async def _reply(scope, send, status: int, message: str, param: str | None, code: str) -> None:
    body = error_response(status, message, code, param, path=scope.get("path", "")).body  # the API's own shape
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
