"""Ranking a user's passages for a question: full-text, vectors, and the two fused by rank.

Full-text search runs in the database: SQLite's FTS5 index (BM25) or PostgreSQL's `to_tsvector` GIN
index (`ts_rank`), both with English stemming, any of the question's words matching. Vector search is
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


def terms(query: str) -> list[str]:
    """The question's words, lowercased, in order, each once: safe to put in either engine's query syntax."""
    seen: dict[str, None] = {}
    for w in _WORD.findall(query.lower()):
        seen.setdefault(w, None)
    return list(seen)[:MAX_TERMS]


async def fulltext(session: AsyncSession, user_id: str, file_ids: list[str], query: str, limit: int) -> list[int]:
    """Passage ids of `file_ids` (the user's) matching any word of `query`, best first."""
    words = terms(query)
    if not words or not file_ids:
        return []
    if session.bind.dialect.name == "sqlite":
        sql = text("SELECT c.id FROM file_chunks_fts JOIN file_chunks c ON c.id = file_chunks_fts.rowid "
                   "WHERE file_chunks_fts MATCH :q AND c.user_id = :user AND c.file_id IN :files "
                   "ORDER BY bm25(file_chunks_fts) LIMIT :n")
        q = " OR ".join(f'"{w}"' for w in words)
    else:
        sql = text(f"SELECT id FROM file_chunks WHERE user_id = :user AND file_id IN :files "
                   f"AND to_tsvector('{TS_CONFIG}', text) @@ to_tsquery('{TS_CONFIG}', :q) "
                   f"ORDER BY ts_rank(to_tsvector('{TS_CONFIG}', text), to_tsquery('{TS_CONFIG}', :q)) DESC, id "
                   f"LIMIT :n")
        q = " | ".join(words)
    sql = sql.bindparams(bindparam("files", expanding=True))
    rows = await session.execute(sql, {"q": q, "user": user_id, "files": list(file_ids), "n": limit})
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
