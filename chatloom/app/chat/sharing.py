"""Read-only links to a conversation as it is when shared.

A link holds a copy of the shared branch (each message's role, text and time), taken when it is made:
later messages, other branches, tool steps, reasoning and files are never read through it. Its token
(secrets.token_urlsafe, 256 bits) is the only credential, so anyone holding the link can read it,
and the owner can revoke it at any time.
"""
from __future__ import annotations

import secrets

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.chat.branches import Tree
from chatloom.app.core.errors import ApiError
from chatloom.store import Conversation, Message, Messages, SharedLink

TOKEN_BYTES = 32

def snapshot(branch: list[Message]) -> list[dict]:
    """The shared copy of a branch: role, text and time of each message, nothing else. An answer still
    being written has no text yet (it streams into answer_chunks), so it is left out."""
    return [{"role": m.role, "text": m.text, "created": m.created.isoformat() if m.created else None}
            for m in branch if m.text]


async def create_link(session: AsyncSession, conv: Conversation, message_id: str | None) -> SharedLink:
    """A link to the conversation's active branch, or to the branch from its root up to `message_id`."""
    tree = Tree(await Messages(session).all_in(conv.id))
    if message_id is not None:
        if message_id not in tree:
            raise ApiError(404, f"message {message_id!r} is not in this conversation", "message_not_found",
                           "message_id")
        branch = tree.path_to(message_id)  # up to it: nothing below the chosen message
    else:
        branch = tree.branch(tree.default_leaf(conv.current_leaf_id))
    messages = snapshot(branch)
    if not messages:
        raise ApiError(400, "the conversation has no messages to share yet", "empty_conversation")
    link = SharedLink(token=secrets.token_urlsafe(TOKEN_BYTES), user_id=conv.user_id, conversation_id=conv.id,
                      upto_message_id=branch[-1].id, title=conv.title or "New chat", messages=messages)
    session.add(link)
    await session.flush()
    return link


async def links_of(session: AsyncSession, user_id: str) -> list[SharedLink]:
    """The user's links, newest first."""
    rows = await session.scalars(select(SharedLink).where(SharedLink.user_id == user_id)
                                 .order_by(SharedLink.created.desc(), SharedLink.id.desc()))
    return list(rows)


async def by_token(session: AsyncSession, token: str) -> SharedLink | None:
    return await session.scalar(select(SharedLink).where(SharedLink.token == token))


async def revoke(session: AsyncSession, user_id: str, link_id: str) -> bool:
    """Delete the user's link; False when it is not the user's (or does not exist)."""
    result = await session.execute(delete(SharedLink).where(SharedLink.id == link_id, SharedLink.user_id == user_id))
    return result.rowcount > 0
