"""Search over the user's own past conversations: messages containing every word of the query,
newest first, with their conversation's title. Only the caller's conversations are searched."""
from __future__ import annotations

from sqlalchemy import select

from chatloom.app.generation.tool_calls import ToolSpec
from chatloom.app.tools.registry import Tool, ToolContext, ToolFailure
from chatloom.store.models import Conversation, Message

MAX_HITS = 5
SNIPPET_CHARS = 200


def _escape(word: str) -> str:
    return word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


async def _run(args: dict, ctx: ToolContext) -> str:
    words = args["query"].split()[:8]
    if not words:
        raise ToolFailure("the query is empty")
    stmt = (select(Message.text, Message.role, Conversation.title)
            .join(Conversation, Conversation.id == Message.conversation_id)
            .where(Conversation.user_id == ctx.user.id, Message.conversation_id != ctx.conversation_id))
    for w in words:
        stmt = stmt.where(Message.text.ilike(f"%{_escape(w)}%", escape="\\"))
    stmt = stmt.order_by(Message.created.desc()).limit(MAX_HITS)
    async with ctx.db.session() as session:
        rows = (await session.execute(stmt)).all()
    if not rows:
        return "no past messages match"
    lines = []
    for text, role, title in rows:
        snippet = " ".join(text.split())[:SNIPPET_CHARS]
        lines.append(f"- [{title or 'untitled'}] {role}: {snippet}")
    return "\n".join(lines)


TOOL = Tool(ToolSpec("search", "Search the user's own past conversations for messages containing the words.",
                     {"type": "object", "properties": {"query": {"type": "string"}},
                      "required": ["query"], "additionalProperties": False}), _run)
