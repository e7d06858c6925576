"""A batch's input file, line by line: each JSON line checked as OpenAI's batch request object
({"custom_id", "method": "POST", "url", "body"}), its body checked by the endpoint it names. A line that
fails a check becomes a failed line with its line number and the reason; it never fails the batch."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Awaitable, Callable

from chatloom.store import User

MAX_LINES = 50_000  # requests in one batch, as OpenAI allows
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class Endpoint:
    """One URL a batch may target. `check(body)` says why a body is no valid request (None: it is);
    `run(user, body, request_id)` answers it through the generation pipeline in the batch class and returns
    the response body, raising ApiError for a refusal (as the HTTP route would answer it)."""

    check: Callable[[dict], str | None]
    run: Callable[[User, dict, str], Awaitable[dict]]


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, counting every line of the file (blank ones too)
    custom_id: str | None
    body: dict | None  # None when the line is no valid request
    code: str | None = None  # why not
    message: str | None = None


class InputError(ValueError):
    """The file as a whole cannot be a batch (empty, too many lines): the batch fails with this."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse(data: bytes, url: str, endpoint: Endpoint) -> list[Line]:
    """Every non-blank line of a JSONL file, checked; raises InputError for a file that is no batch."""
    lines: list[Line] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        if len(lines) >= MAX_LINES:
            raise InputError("too_many_requests", f"the input file has more than {MAX_LINES} requests")
        line = _check(number, raw, url, endpoint)
        if line.custom_id is not None and line.body is not None:
            if line.custom_id in seen:
                line = Line(number, line.custom_id, None, "duplicate_custom_id",
                            f"line {number}: custom_id {line.custom_id!r} is already used by an earlier line")
            seen.add(line.custom_id)
        lines.append(line)
    if not lines:
        raise InputError("empty_file", "the input file has no request lines")
    return lines


def _check(number: int, raw: bytes, url: str, endpoint: Endpoint) -> Line:
    def bad(code: str, why: str, custom_id: str | None = None) -> Line:
        return Line(number, custom_id, None, code, f"line {number}: {why}")

    try:
        item = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return bad("invalid_json_line", "not UTF-8 text")
    except ValueError as exc:
        return bad("invalid_json_line", f"not valid JSON ({exc})")
    if not isinstance(item, dict):
        return bad("invalid_json_line", "a request line must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return bad("missing_custom_id", f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters")
    if item.get("method", "POST") != "POST":
        return bad("invalid_method", f"method must be POST, not {item.get('method')!r}", custom_id)
    if item.get("url") != url:
        return bad("invalid_url", f"url must be this batch's endpoint {url!r}, not {item.get('url')!r}", custom_id)
    body = item.get("body")
    if not isinstance(body, dict):
        return bad("invalid_request", "body must be a JSON object (the request)", custom_id)
    if body.get("stream"):
        return bad("invalid_request", "stream is not supported in a batch", custom_id)
    why = endpoint.check(body)
    if why is not None:
        return bad("invalid_request", why, custom_id)
    return Line(number, custom_id, body)
