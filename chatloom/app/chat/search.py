"""Full-text search over one user's conversations: titles and every message, on every branch.

The database's own index answers (SQLite FTS5 over `chat_fts`, kept by triggers; PostgreSQL GIN indexes
on `to_tsvector('english', ...)` of titles and messages; migration 0010). Every word of the query must
match, the last as a prefix (so results follow typing). Conversations are ranked by their best hit (BM25
or `ts_rank`; a title hit counts double), each with that hit's snippet. Only the caller's rows are ever
read: the user id is in every query.

Snippets come back HTML-safe: the text is escaped, and the matched words are wrapped in <mark>.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.files.search import terms
from chatloom.store import Conversation
from chatloom.store.file_chunks import TS_CONFIG

# Markers around matches inside the database's snippet, swapped for <mark> once the text is escaped.
_OPEN, _CLOSE = "\ue000", "\ue001"
CANDIDATES = 500  # hits read before grouping them by conversation


@dataclass(frozen=True)
class Hit:
    conversation: Conversation
    message_id: str | None  # None: the title matched
    snippet: str  # HTML: escaped text, matches in <mark>


def snippet_html(raw: str) -> str:
    clean = raw.replace("<mark>", "").replace("</mark>", "")
    return html.escape(clean).replace(_OPEN, "<mark>").replace(_CLOSE, "</mark>")


async def search_conversations(session: AsyncSession, user_id: str, query: str, limit: int = 20,
                               offset: int = 0) -> list[Hit]:
    words = terms(query)
    if not words:
        return []
    if session.bind.dialect.name == "sqlite":
        q = " ".join(f'"{w}"' for w in words) + "*"
        rows = await session.execute(text(
            f"SELECT conversation_id, message_id, snippet(chat_fts, 0, '{_OPEN}', '{_CLOSE}', '…', 16), "
            "bm25(chat_fts) * (CASE kind WHEN 'title' THEN 2.0 ELSE 1.0 END) AS score "
            "FROM chat_fts WHERE chat_fts MATCH :q AND user_id = :user ORDER BY score LIMIT :n"),
            {"q": q, "user": user_id, "n": CANDIDATES})
    else:
        q = " & ".join(words) + ":*"
        options = f"StartSel={_OPEN}, StopSel={_CLOSE}, MaxWords=24, MinWords=8, MaxFragments=1"
        rows = await session.execute(text(
            f"WITH query AS (SELECT to_tsquery('{TS_CONFIG}', :q) AS q) "
            f"SELECT m.conversation_id, m.id, ts_headline('{TS_CONFIG}', m.text, query.q, :opts), "
            f"ts_rank(to_tsvector('{TS_CONFIG}', m.text), query.q, 1) AS score "
            f"FROM messages m JOIN conversations c ON c.id = m.conversation_id, query "
            f"WHERE c.user_id = :user AND to_tsvector('{TS_CONFIG}', m.text) @@ query.q "
            f"UNION ALL "
            f"SELECT c.id, NULL, ts_headline('{TS_CONFIG}', c.title, query.q, :opts), "
            f"2 * ts_rank(to_tsvector('{TS_CONFIG}', coalesce(c.title, '')), query.q, 1) AS score "
            f"FROM conversations c, query "
            f"WHERE c.user_id = :user AND to_tsvector('{TS_CONFIG}', coalesce(c.title, '')) @@ query.q "
            f"ORDER BY score DESC LIMIT :n"), {"q": q, "user": user_id, "n": CANDIDATES, "opts": options})
    best: dict[str, tuple[str | None, str]] = {}
    for conversation_id, message_id, snip, _score in rows:
        best.setdefault(conversation_id, (message_id, snip or ""))
    wanted = list(best)[offset:offset + limit]
    if not wanted:
        return []
    convs = {c.id: c for c in await session.scalars(select(Conversation).where(
        Conversation.id.in_(wanted), Conversation.user_id == user_id))}
    return [Hit(convs[cid], best[cid][0], snippet_html(best[cid][1])) for cid in wanted if cid in convs]
