"""What an API key may do. A key holds a set of scopes; a session token (someone who signed in)
holds every right of its account.

- read: GET and HEAD requests outside /admin (conversations, files, models, usage);
- chat: every other request outside /admin (generating, writing, deleting);
- admin: /admin routes, and only for an admin account's key.
"""
from __future__ import annotations

SCOPES = ("read", "chat", "admin")
DEFAULT_KEY_SCOPES = ("read", "chat")
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def parse_scopes(text: str) -> frozenset[str]:
    return frozenset(part for part in text.split() if part in SCOPES)


def format_scopes(scopes: frozenset[str] | set[str] | list[str] | tuple[str, ...]) -> str:
    return " ".join(s for s in SCOPES if s in scopes)


def scope_for(method: str, path: str) -> str:
    """The scope a request needs."""
    if path == "/admin" or path.startswith("/admin/"):
        return "admin"
    return "read" if method.upper() in READ_METHODS else "chat"
