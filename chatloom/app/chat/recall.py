"""The older turns of a long conversation most relevant to a new message, found by full-text search.

When a conversation outgrows the context window, its oldest turns leave the prompt; a summary keeps
their gist (conversation_prompt.py). Retrieval brings back, verbatim, the few older turns that bear on
the new message ("what was the code name we agreed on?"), ranked by the database's own full-text index
over messages (SQLite's `chat_fts`, PostgreSQL's GIN index on messages), with the same query as file
retrieval: content words and adjacent-word phrases (files/search.py). `chat.older_turns` chooses
summary, retrieved turns or both; `chat.retrieved_turns_tokens` bounds what they take.
"""
from __future__ import annotations

from sqlalchemy import bindparam, text
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.chat.prompt import Turn, transcript
from chatloom.app.files.search import (POSTGRES_PHRASES, TS_CONFIG, fts5_query, postgres_params, postgres_rank,
                                       terms)

RECALL_HEADER = "\n\nEarlier turns of this conversation that bear on the new message:\n"
CANDIDATES = 8  # ranked turns read per message; the token budget usually keeps fewer

_SQLITE = ("SELECT message_id FROM chat_fts WHERE chat_fts MATCH :q AND kind = 'message' "
           "AND conversation_id = :conversation AND message_id IN :ids ORDER BY bm25(chat_fts) LIMIT :n")
_POSTGRES = (f"SELECT id FROM (SELECT id, to_tsvector('{TS_CONFIG}', text) AS v FROM messages "
             f"WHERE conversation_id = :conversation AND id IN :ids AND to_tsvector('{TS_CONFIG}', text) @@ "
             f"to_tsquery('{TS_CONFIG}', :words)) AS m, {POSTGRES_PHRASES} ORDER BY {postgres_rank('m.v')} DESC, m.id "
             f"LIMIT :n")


async def relevant_turns(session: AsyncSession, conversation_id: str, turns: list[Turn], query: str,
                         limit: int = CANDIDATES) -> list[tuple[int, Turn]]:
    """Of `turns` (earlier turns of the conversation's branch, oldest first, which the caller owns), those
    matching `query`, best first, at most `limit`, each with its place in `turns`."""
    by_id = {t.id: (i, t) for i, t in enumerate(turns) if t.id}
    if not by_id or not terms(query):
        return []
    params: dict = {"conversation": conversation_id, "ids": list(by_id), "n": limit}
    if session.bind.dialect.name == "sqlite":
        sql = _SQLITE
        params["q"] = fts5_query(query)
    else:
        sql = _POSTGRES
        params.update(postgres_params(query))
    rows = await session.execute(text(sql).bindparams(bindparam("ids", expanding=True)), params)
    return [by_id[r[0]] for r in rows if r[0] in by_id]


def recalled_text(turns: list[Turn]) -> str:
    """What the system message gains: the header and the turns, oldest first, as a transcript."""
    return RECALL_HEADER + transcript(turns) if turns else ""
