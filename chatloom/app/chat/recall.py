"""The older turns of a long conversation most relevant to a new message, found by full-text search.

When a conversation outgrows the context window, its oldest turns leave the prompt; a summary keeps
their gist (conversation_prompt.py). Retrieval brings back, verbatim, the few older turns that bear on
the new message ("what was the code name we agreed on?"), ranked by the database's own full-text index
over messages (SQLite's `chat_fts`; on PostgreSQL BM25 over the turns' tsvectors, files/pg_fulltext.py), with
the same query as file retrieval: content words and adjacent-word phrases (files/search.py). `chat.older_turns` chooses
summary, retrieved turns or both; `chat.retrieved_turns_tokens` bounds what they take.
"""
from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.chat.prompt import Turn, transcript
from chatloom.app.files.search import ranked_ids, terms
from chatloom.store.file_chunks import rank_tsvector

RECALL_HEADER = "\n\nEarlier turns of this conversation that bear on the new message:\n"
CANDIDATES = 8  # ranked turns read per message; the token budget usually keeps fewer

_SQLITE = ("SELECT message_id AS id, {weight} * bm25(chat_fts) AS s FROM chat_fts WHERE chat_fts MATCH :{q} "
           "AND kind = 'message' AND conversation_id = :conversation AND message_id IN :ids")
_POSTGRES_SCOPE = (f"SELECT id, {rank_tsvector('text')} AS v FROM messages "
                   "WHERE conversation_id = :conversation AND id IN :ids")


async def relevant_turns(session: AsyncSession, conversation_id: str, turns: list[Turn], query: str,
                         limit: int = CANDIDATES) -> list[tuple[int, Turn]]:
    """Of `turns` (earlier turns of the conversation's branch, oldest first, which the caller owns), those
    matching `query`, best first, at most `limit`, each with its place in `turns`."""
    by_id = {t.id: (i, t) for i, t in enumerate(turns) if t.id}
    if not by_id or not terms(query):
        return []
    ids = await ranked_ids(session, query, {"conversation": conversation_id, "ids": list(by_id)}, "ids",
                           _SQLITE, _POSTGRES_SCOPE, limit)
    return [by_id[i] for i in ids if i in by_id]


def recalled_text(turns: list[Turn]) -> str:
    """What the system message gains: the header and the turns, oldest first, as a transcript."""
    return RECALL_HEADER + transcript(turns) if turns else ""
