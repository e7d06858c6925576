"""Secrets never reach the logs: every log record's text is cleaned as the record is made.

Installed once per process (`install`), as a log record factory, so it covers every logger (uvicorn's
access log with its request lines, libraries, our own) and every handler, whatever is configured later.
Database drivers, which log statements with their values, are kept at warning. What is removed: API keys, bearer credentials and JWTs anywhere in the text, the token of a shared link
in a path, and the values of query parameters that carry secrets (an SSO callback's code and state)."""
from __future__ import annotations

import logging
import re

from chatloom.app.core.auth import API_KEY_PREFIX

REDACTED = "[redacted]"

_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # API keys: the prefix and 32 random bytes in URL-safe base64.
    (re.compile(re.escape(API_KEY_PREFIX) + r"[A-Za-z0-9_\-]{16,}"), API_KEY_PREFIX + REDACTED),
    # JWTs (session tokens, ID tokens): three base64url parts, the first a JSON header.
    (re.compile(r"eyJ[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]*"), REDACTED),
    (re.compile(r"(?i)\b(bearer|basic)\s+[^\s\"',;]+"), r"\1 " + REDACTED),
    # A shared link's token is its only credential.
    (re.compile(r"(/s/)[A-Za-z0-9_\-]{16,}"), r"\1" + REDACTED),
    (re.compile(r"(?i)([?&](?:code|state|token|access_token|id_token|refresh_token|api_key|key|password|"
                r"client_secret)=)[^&\s\"']+"), r"\1" + REDACTED),
    (re.compile(r"(?i)(\"(?:password|client_secret|api_key|token|access_token|id_token)\"\s*:\s*\")[^\"]*"),
     r"\1" + REDACTED),
]


def redact(text: str) -> str:
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def _clean(value: object) -> object:
    """A string argument redacted; any other object replaced by its redacted text only where that text
    held a secret (an exception naming a URL with a key), so numbers keep their formats."""
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    text = value if isinstance(value, str) else str(value)
    cleaned = redact(text)
    return cleaned if isinstance(value, str) or cleaned != text else value


# Database drivers log each statement with its bound values at debug (and SQLAlchemy at info): users'
# messages, password hashes, share tokens. Whatever the server's log level, they say nothing below warning.
DATA_LOGGERS = ("aiosqlite", "sqlalchemy.engine", "sqlalchemy.pool", "asyncpg")

_installed = False


def install() -> None:
    """Make every log record's message redacted from now on (idempotent)."""
    global _installed
    for name in DATA_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    if _installed:
        return
    base = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = base(*args, **kwargs)
        # The message and each argument are cleaned apart, keeping the arguments' shape: some formatters
        # (uvicorn's access log) unpack them.
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_clean(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _clean(v) for k, v in record.args.items()}
        return record

    logging.setLogRecordFactory(factory)
    _installed = True
