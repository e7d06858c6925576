"""Sends and regenerations repeated with the same Idempotency-Key.

A client whose POST of a message broke before the reply cannot tell whether a gateway stored it: the
connection may have dropped after the commit, or the gateway may have been paused and store it seconds
later. Sending it again with the key it used the first time is always safe: the key is kept with the user
message, unique within the conversation, so the repeat finds what the first send stored (and streams its
answer) rather than storing, answering and billing the message a second time. A regeneration keeps its key
with the new answer in the same way, so a repeat streams that answer instead of starting another sibling.
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
    if sent.role != "user" or sent.text != text:
        raise ApiError(422, f"this {HEADER} was used for another message in this conversation; use a new key "
                       "for a new message", "idempotency_key_reused", HEADER)
    answer = await messages.first_answer(sent.id)
    if answer is None:  # stored together with its message; gone only if someone deleted it
        raise ApiError(409, "this message was already sent, and its answer has been deleted", "already_sent",
                       HEADER)
    return sent.id, answer.id


async def earlier_regeneration(session: AsyncSession, conversation_id: str, key: str,
                               message_id: str) -> tuple[str, str] | None:
    """(question id, answer id) of the answer a regeneration with this key started, None when none did;
    422 when the key was used for something else: a message, or a new answer to another question than
    `message_id`'s."""
    messages = Messages(session)
    sent = await messages.by_client_key(conversation_id, key)
    if sent is None:
        return None
    target = await messages.get(conversation_id, message_id)
    question_id = None if target is None else target.id if target.role == "user" else target.parent_id
    if sent.role != "assistant" or question_id is None or sent.parent_id != question_id:
        raise ApiError(422, f"this {HEADER} was used for another request in this conversation; use a new key "
                       "for a new answer", "idempotency_key_reused", HEADER)
    return question_id, sent.id
