"""Ranking a user's passages for a question: full-text, vectors, and the two fused by rank.

Full-text search runs in the database, with BM25 on both: SQLite's FTS5 index, or PostgreSQL's GIN-indexed
tsvector column scored as FTS5 scores (pg_fulltext.py), both with English stemming. The query is an OR
of the question's content words (its function words dropped, so "what" and "the" neither match every
passage nor weigh in the ranking) and of each pair of adjacent words as a phrase: a passage holding
"session token" as the question says it outranks one that has both words apart (docs/files.md has the
figures). Vector search is exact: the dot product of the question's unit vector with every vector of the
passages in scope, which are only the user's own (a few thousand at most), so no approximate index is
needed; pgvector or sqlite-vec order them in the database where installed, numpy otherwise. The two
rankings are fused by reciprocal rank (RRF): a passage scores sum(1 / (k + rank)) over the rankings it is
in, so neither score scale has to be calibrated against the other.
"""
from __future__ import annotations

import numpy as np
from sqlalchemy import bindparam, text
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.files.pg_fulltext import ranking_params, ranking_sql, score, split
from chatloom.app.files.query import STOP_WORDS, fts5_parts, fts5_query, query_terms, terms  # noqa: F401 - re-exported
from chatloom.store.vector_index import PG_COLUMN, PGVECTOR, SQLITE_VEC, pg_literal

_POSTGRES_SCOPE = "SELECT id, text_fts AS v FROM file_chunks WHERE user_id = :user AND file_id IN :files"
# CROSS JOIN: SQLite then runs the full-text query once and looks up each hit's passage. With a plain
# JOIN its planner may start from the user's passages (their user_id index) and run the MATCH once per
# passage: 0.4 s instead of milliseconds for 1,000 passages.
_SQLITE_FULLTEXT = (
    "SELECT c.id AS id, {weight} * bm25(file_chunks_fts) AS s FROM file_chunks_fts "
    "CROSS JOIN file_chunks c ON c.id = file_chunks_fts.rowid "
    "WHERE file_chunks_fts MATCH :{q} AND c.user_id = :user AND c.file_id IN :files")


async def ranked_ids(session: AsyncSession, query: str, params: dict, in_list: str, sqlite_sql: str,
                     postgres_scope: str, limit: int) -> list:
    """Ids of the rows in scope matching any content word or phrase of `query`, best first (ties by id),
    at most `limit`: FTS5's BM25 on SQLite, pg_fulltext's over `postgres_scope` on PostgreSQL.
    `sqlite_sql` selects `id` and a BM25 score `s` of the rows in scope matching `:{q}`, times `{weight}`:
    it runs once per part of `fts5_parts` and the parts' scores are added. `params` bind both
    statements; `in_list` names the one that is a list (`IN :name`)."""
    expand = bindparam(in_list, expanding=True)
    if session.bind.dialect.name == "sqlite":
        parts = fts5_parts(query)
        if not parts:
            return []
        union = " UNION ALL ".join(sqlite_sql.format(weight=float(w), q=f"q{i}") for i, (_, w) in enumerate(parts))
        # MATERIALIZED: flattened into the aggregate (as SQLite does with a lone part), bm25() would be
        # called outside its full-text query, which FTS5 refuses. FTS5's bm25 is negative: best first.
        sql = f"WITH scored AS MATERIALIZED ({union}) SELECT id FROM scored GROUP BY id ORDER BY sum(s), id LIMIT :n"
        rows = await session.execute(text(sql).bindparams(expand),
                                     {**params, **{f"q{i}": q for i, (q, _) in enumerate(parts)}, "n": limit})
        return [r[0] for r in rows]
    rows = await session.execute(text(ranking_sql(postgres_scope)).bindparams(expand),
                                 {**params, **ranking_params(*query_terms(query))})
    hits, found = split(rows.all())
    return score(hits, found, limit)


async def fulltext(session: AsyncSession, user_id: str, file_ids: list[str], query: str, limit: int) -> list[int]:
    """Passage ids of `file_ids` (the user's) matching any content word or phrase of `query`, best first."""
    if not terms(query) or not file_ids:
        return []
    return await ranked_ids(session, query, {"user": user_id, "files": list(file_ids)}, "files",
                            _SQLITE_FULLTEXT, _POSTGRES_SCOPE, limit)


_NEAREST_SCOPE = ("FROM file_chunks WHERE user_id = :user AND file_id IN :files AND embedding IS NOT NULL "
                  "AND embedding_model = :model")
# In the database, where it has an extension for vectors (store/vector_index.py): the same exact ranking.
_NEAREST_SQL = {
    PGVECTOR: (f"SELECT id {_NEAREST_SCOPE} AND vector_dims({PG_COLUMN}) = :width "
               f"ORDER BY {PG_COLUMN} <#> CAST(:q AS vector), id LIMIT :n"),
    SQLITE_VEC: (f"SELECT id {_NEAREST_SCOPE} AND length(embedding) = 4 * :width "
                 "ORDER BY vec_distance_cosine(embedding, :q), id LIMIT :n"),
}


async def nearest(session: AsyncSession, user_id: str, file_ids: list[str], vector: list[float], model: str,
                  limit: int, extension: str | None = None) -> list[int]:
    """Passage ids of `file_ids` (the user's) by cosine similarity to `vector`, best first, ties by id: an
    exact search, in the database with `extension` ("pgvector", "sqlite-vec"), else in numpy."""
    if not file_ids:
        return []
    params = {"user": user_id, "files": list(file_ids), "model": model}
    if extension is not None:
        q = pg_literal(vector) if extension == PGVECTOR else pack(vector)
        sql = text(_NEAREST_SQL[extension]).bindparams(bindparam("files", expanding=True))
        rows = await session.execute(sql, {**params, "q": q, "width": len(vector), "n": limit})
        return [r[0] for r in rows]
    sql = text(f"SELECT id, embedding {_NEAREST_SCOPE} ORDER BY id").bindparams(bindparam("files", expanding=True))
    rows = (await session.execute(sql, params)).all()
    q = np.asarray(vector, dtype=np.float32)
    rows = [(i, e) for i, e in rows if len(e) == 4 * len(q)]
    if not rows:
        return []
    matrix = np.frombuffer(b"".join(e for _, e in rows), dtype="<f4").reshape(len(rows), len(q))
    scores = matrix @ q
    order = np.argsort(-scores, kind="stable")[:limit]
    return [rows[i][0] for i in order]


def fuse(rankings: list[list[int]], k: int, weights: list[float] | None = None) -> list[int]:
    """Reciprocal rank fusion of several best-first id lists, each ranking's terms times its weight
    (default 1); ties keep the first ranking's order."""
    score: dict[int, float] = {}
    for ranking, weight in zip(rankings, weights or [1.0] * len(rankings)):
        for rank, item in enumerate(ranking):
            score[item] = score.get(item, 0.0) + weight / (k + rank + 1)
    return sorted(score, key=lambda i: -score[i])


def pack(vector: list[float]) -> bytes:
    """A vector as stored: little-endian float32."""
    return np.asarray(vector, dtype="<f4").tobytes()
