"""Sends repeated with the same Idempotency-Key.

A client whose POST of a message broke before the reply cannot tell whether a gateway stored it: the
connection may have dropped after the commit, or the gateway may have been paused and store it seconds
later. Sending it again with the key it used the first time is always safe: the key is kept with the user
message, unique within the conversation, so the repeat finds what the first send stored (and streams its
answer) rather than storing, answering and billing the message a second time.
"""
from __future__ import annotations

import re

from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.core.errors import ApiError
from chatloom.store import Messages

HEADER = "Idempotency-Key"
_KEY = re.compile(r"[\x21-\x7e]{1,100}")  # visible ASCII, as a header value carries it unchanged


class AlreadySent(Exception):
    """A concurrent send with the same key stored the message first."""


def checked_key(value: str | None) -> str | None:
    """The header's key, or None without one; 400 when it is not 1-100 visible ASCII characters."""
    if value is None:
        return None
    if not _KEY.fullmatch(value):
        raise ApiError(400, f"{HEADER} must be 1 to 100 visible ASCII characters (a UUID, say)",
                       "invalid_idempotency_key", HEADER)
    return value


async def earlier_send(session: AsyncSession, conversation_id: str, key: str, text: str) -> tuple[str, str] | None:
    """(user message id, answer id) of the send that stored this key, None when none did; 422 when that
    send's text differs: the key names another message."""
    messages = Messages(session)
    sent = await messages.by_client_key(conversation_id, key)
    if sent is None:
        return None
    if sent.text != text:
        raise ApiError(422, f"this {HEADER} was used for another message in this conversation; use a new key "
                       "for a new message", "idempotency_key_reused", HEADER)
    answer = await messages.first_answer(sent.id)
    if answer is None:  # stored together with its message; gone only if someone deleted it
        raise ApiError(409, "this message was already sent, and its answer has been deleted", "already_sent",
                       HEADER)
    return sent.id, answer.id
