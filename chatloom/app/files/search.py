"""Ranking a user's passages for a question: full-text, vectors, and the two fused by rank.

Full-text search runs in the database: SQLite's FTS5 index (BM25) or PostgreSQL's GIN-indexed tsvector
column (`ts_rank`), both with English stemming. The query is an OR of the question's content words (its
function words dropped, so "what" and "the" neither match every passage nor cost a scan of them) and of
each pair of adjacent words as a phrase: a passage holding "session token" as the question says it
outranks one that has both words apart (docs/files.md has the figures). Vector search is
exact: the dot product of the question's unit vector with every vector of the passages in scope, which
are only the user's own (a few thousand at most), so no approximate index is needed. The two rankings
are fused by reciprocal rank (RRF): a passage scores sum(1 / (k + rank)) over the rankings it is in,
so neither score scale has to be calibrated against the other.
"""
from __future__ import annotations

import re

import numpy as np
from sqlalchemy import bindparam, text
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.store.file_chunks import TS_CONFIG

_WORD = re.compile(r"[^\W_]+", re.UNICODE)
MAX_TERMS = 32
MAX_PHRASES = 24

# English function words: left out of a question's single terms (they still join its phrases). Both
# databases then rank the same terms; PostgreSQL's english configuration drops its own list besides.
STOP_WORDS = frozenset("""
a an the this that these those there here
i me my we us our you your he him his she her it its they them their
what which who whom whose when where why how
is are was were be been being am do does did done doing have has had having
can could shall should will would may might must
and or but if then than so not no nor as of at by for from in into on onto out over to up with
about after before between through under until while during without within
all any both each few more most other some such own same only very too just also
s t
""".split())


def terms(query: str) -> list[str]:
    """The question's words, lowercased, in order, each once: safe to put in either engine's query syntax."""
    seen: dict[str, None] = {}
    for w in _WORD.findall(query.lower()):
        seen.setdefault(w, None)
    return list(seen)[:MAX_TERMS]


def query_terms(query: str) -> tuple[list[str], list[tuple[str, str]]]:
    """What a question is searched by: its content words (all its words when it has no other) and each
    pair of adjacent words, function words included ("not exist", "per block")."""
    words = terms(query)
    content = [w for w in words if w not in STOP_WORDS] or words
    seen = list(_WORD.findall(query.lower()))
    phrases = list(dict.fromkeys(zip(seen, seen[1:])))[:MAX_PHRASES]
    return content, phrases


def fts5_query(query: str) -> str:
    """The OR query of `query_terms` in FTS5's syntax: quoted words and phrases ("" without words). FTS5's
    BM25 scores each phrase as a term of its own, so a rare phrase weighs as a rare word does. The words
    are letters and digits only, so nothing in them is taken as syntax."""
    words, phrases = query_terms(query)
    return " OR ".join([f'"{w}"' for w in words] + [f'"{a} {b}"' for a, b in phrases])


# The question's phrases as tsqueries, parsed once per query (not once per passage): a FROM item.
POSTGRES_PHRASES = (f"(SELECT array_agg(to_tsquery('{TS_CONFIG}', s.p)) AS qs "
                    f"FROM unnest(CAST(:phrases AS text[])) AS s(p)) AS phrase_queries")


def postgres_rank(vector: str) -> str:
    """A PostgreSQL rank of the tsvector `vector` for the `postgres_params` of a question, in a query FROM
    `POSTGRES_PHRASES`. ts_rank does not see a phrase's word order, so each phrase the text holds adds its
    own rank on top of the words' (the role a phrase's BM25 term plays in FTS5)."""
    return (f"ts_rank({vector}, to_tsquery('{TS_CONFIG}', :words)) + coalesce((SELECT sum(ts_rank({vector}, q)) "
            f"FROM unnest(phrase_queries.qs) AS q WHERE {vector} @@ q), 0)")


def postgres_params(query: str) -> dict[str, object]:
    """`:words` (a tsquery OR of the content words) and `:phrases` (tsquery phrases) for `postgres_rank`."""
    words, phrases = query_terms(query)
    return {"words": " | ".join(words), "phrases": [f"{a} <-> {b}" for a, b in phrases]}


# file_chunks.text_fts: the passage's stored tsvector (migration 0014), GIN-indexed.
_POSTGRES_FULLTEXT = (
    f"SELECT id FROM file_chunks, {POSTGRES_PHRASES} WHERE user_id = :user AND file_id IN :files "
    f"AND text_fts @@ to_tsquery('{TS_CONFIG}', :words) ORDER BY {postgres_rank('text_fts')} DESC, id LIMIT :n")
_SQLITE_FULLTEXT = (
    "SELECT c.id FROM file_chunks_fts JOIN file_chunks c ON c.id = file_chunks_fts.rowid "
    "WHERE file_chunks_fts MATCH :q AND c.user_id = :user AND c.file_id IN :files "
    "ORDER BY bm25(file_chunks_fts) LIMIT :n")


async def fulltext(session: AsyncSession, user_id: str, file_ids: list[str], query: str, limit: int) -> list[int]:
    """Passage ids of `file_ids` (the user's) matching any content word or phrase of `query`, best first."""
    if not terms(query) or not file_ids:
        return []
    params: dict = {"user": user_id, "files": list(file_ids), "n": limit}
    if session.bind.dialect.name == "sqlite":
        sql = _SQLITE_FULLTEXT
        params["q"] = fts5_query(query)
    else:
        sql = _POSTGRES_FULLTEXT
        params.update(postgres_params(query))
    rows = await session.execute(text(sql).bindparams(bindparam("files", expanding=True)), params)
    return [r[0] for r in rows]


async def nearest(session: AsyncSession, user_id: str, file_ids: list[str], vector: list[float], model: str,
                  limit: int) -> list[int]:
    """Passage ids of `file_ids` (the user's) by cosine similarity to `vector`, best first (exact search)."""
    if not file_ids:
        return []
    sql = text("SELECT id, embedding FROM file_chunks WHERE user_id = :user AND file_id IN :files "
               "AND embedding IS NOT NULL AND embedding_model = :model").bindparams(bindparam("files", expanding=True))
    rows = (await session.execute(sql, {"user": user_id, "files": list(file_ids), "model": model})).all()
    q = np.asarray(vector, dtype=np.float32)
    rows = [(i, e) for i, e in rows if len(e) == 4 * len(q)]
    if not rows:
        return []
    matrix = np.frombuffer(b"".join(e for _, e in rows), dtype="<f4").reshape(len(rows), len(q))
    scores = matrix @ q
    order = np.argsort(-scores, kind="stable")[:limit]
    return [rows[i][0] for i in order]


def fuse(rankings: list[list[int]], k: int) -> list[int]:
    """Reciprocal rank fusion of several best-first id lists; ties keep the first ranking's order."""
    score: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking):
            score[item] = score.get(item, 0.0) + 1.0 / (k + rank + 1)
    return sorted(score, key=lambda i: -score[i])


def pack(vector: list[float]) -> bytes:
    """A vector as stored: little-endian float32."""
    return np.asarray(vector, dtype="<f4").tobytes()
