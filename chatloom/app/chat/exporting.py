"""Export: a user's conversations as JSON (every branch, chatloom's own format) or Markdown (the
active branch, for reading). The JSON format is what importing.py reads back; docs/accounts.md
describes it."""
from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.chat.branches import Tree
from chatloom.store import Conversation, Message

EXPORT_FORMAT = "chatloom.conversations"
EXPORT_VERSION = 1


def iso(dt: datetime | None) -> str | None:
    if dt is None:
        return None
    if dt.tzinfo is None:  # SQLite hands back naive datetimes, all of which are UTC
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def message_json(m: Message) -> dict:
    return {"id": m.id, "parent_id": m.parent_id, "role": m.role, "text": m.text, "created": iso(m.created),
            "model": m.model, "status": m.status, "reasoning": m.reasoning}


def conversation_json(conv: Conversation, messages: list[Message]) -> dict:
    return {"id": conv.id, "title": conv.title or "New chat", "created": iso(conv.created),
            "updated": iso(conv.updated), "current_leaf_id": conv.current_leaf_id,
            "messages": [message_json(m) for m in sorted(messages, key=lambda m: m.id)]}


async def load(session: AsyncSession, user_id: str, conversation_id: str | None = None
               ) -> list[tuple[Conversation, list[Message]]]:
    """The user's conversations (or the one), newest first, each with all its messages."""
    query = select(Conversation).where(Conversation.user_id == user_id)
    if conversation_id is not None:
        query = query.where(Conversation.id == conversation_id)
    convs = list(await session.scalars(query.order_by(Conversation.updated.desc(), Conversation.id.desc())))
    by_conv: dict[str, list[Message]] = {c.id: [] for c in convs}
    if convs:
        rows = await session.scalars(select(Message).join(Conversation, Message.conversation_id == Conversation.id)
                                     .where(Conversation.user_id == user_id,
                                            Message.conversation_id.in_(list(by_conv))).order_by(Message.id))
        for m in rows:
            by_conv[m.conversation_id].append(m)
    return [(c, by_conv[c.id]) for c in convs]


def export_json(items: list[tuple[Conversation, list[Message]]]) -> dict:
    return {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "exported": iso(datetime.now(timezone.utc)),
            "conversations": [conversation_json(c, ms) for c, ms in items]}


def export_markdown(items: list[tuple[Conversation, list[Message]]]) -> str:
    """Each conversation's active branch: a heading, then each message under its speaker's name."""
    parts = []
    for conv, messages in items:
        tree = Tree(messages)
        lines = [f"# {conv.title or 'New chat'}", "", f"_{iso(conv.created)}_", ""]
        for m in tree.branch(tree.default_leaf(conv.current_leaf_id)):
            if not m.text:
                continue
            lines += [f"## {'User' if m.role == 'user' else 'Assistant'}", "", m.text.rstrip(), ""]
        parts.append("\n".join(lines))
    return "\n---\n\n".join(parts)
