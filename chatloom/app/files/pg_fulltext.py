"""BM25 over PostgreSQL's tsvectors, with phrases: the ranking SQLite's FTS5 gives, on PostgreSQL.

`ts_rank` weighs every word alike (no document frequency) and does not saturate a word repeated, so a
passage saying "token" ten times outranked the one saying "session token" once; ranking every matching
passage with it (and a `ts_rank` per phrase on top) also took about 45 ms over 1,000 passages. Here the
database does what only it can do cheaply: find the passages in scope holding any of the question's
lexemes, and hand back, per passage, only those lexemes with their positions (`setweight` marks them,
`ts_filter` keeps them: one pass over each tsvector, no text parsed again). The scope's size and mean
length come in the same query. Python then scores BM25 as FTS5 does (k1 = 1.2, b = 0.75, a phrase a
term of its own, counted where its two lexemes stand side by side), with document frequencies over the
scope: the user's own passages (or one conversation's messages), never anyone else's.

The tsvectors are of `RANK_TS_CONFIG` (English stems, stop words kept for phrases such as "not exist")
over the text split at every character that is not a letter or digit, as FTS5's tokenizer splits it
(store/file_chunks.py). A question's words are stemmed by PostgreSQL itself in that configuration, once
per word per process: the lexemes of a word never change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.files.query import PHRASE_WEIGHT
from chatloom.store.file_chunks import RANK_TS_CONFIG

K1 = 1.2
B = 0.75
_MIN_IDF = 1e-6  # FTS5's floor for a term in more than half the rows
_LEXEME_CACHE_MAX = 50_000
_lexeme_cache: dict[str, tuple[str, ...]] = {}


async def lexemes(session: AsyncSession, words: list[str]) -> dict[str, tuple[str, ...]]:
    """Each word's lexemes in `RANK_TS_CONFIG`, from a cache or from one query for the words not seen before."""
    missing = [w for w in dict.fromkeys(words) if w not in _lexeme_cache]
    if missing:
        sql = (f"SELECT w, tsvector_to_array(to_tsvector('{RANK_TS_CONFIG}', w)) "
               "FROM unnest(CAST(:words AS text[])) AS t(w)")
        rows = await session.execute(text(sql), {"words": missing})
        if len(_lexeme_cache) + len(missing) > _LEXEME_CACHE_MAX:
            _lexeme_cache.clear()
        for word, found in rows:
            _lexeme_cache[word] = tuple(found or ())
    return {w: _lexeme_cache.get(w, ()) for w in words}


@dataclass(frozen=True)
class Terms:
    """What a question is ranked by, as lexemes: single terms and adjacent pairs."""

    singles: tuple[str, ...]
    phrases: tuple[tuple[str, str], ...]

    @property
    def lexemes(self) -> list[str]:
        return list(dict.fromkeys([*self.singles, *(x for p in self.phrases for x in p)]))

    def tsquery(self) -> str:
        """An OR of the single terms and the phrases, in tsquery's input syntax (lexemes taken as they are,
        not stemmed again)."""
        def quoted(x: str) -> str:
            return "'" + x.replace("'", "''") + "'"
        return " | ".join([quoted(x) for x in self.singles] + [f"{quoted(a)} <-> {quoted(b)}" for a, b in self.phrases])


async def question_terms(session: AsyncSession, words: list[str], phrases: list[tuple[str, str]]) -> Terms:
    """The lexemes of `query_terms`' words and phrases (a word that yields no lexeme, or several, joins no
    phrase)."""
    lex = await lexemes(session, [*words, *(w for p in phrases for w in p)])
    singles = tuple(dict.fromkeys(x for w in words for x in lex[w]))
    pairs = tuple(dict.fromkeys((lex[a][0], lex[b][0]) for a, b in phrases
                                if len(lex[a]) == 1 and len(lex[b]) == 1))
    return Terms(singles, pairs)


def ranking_sql(scope: str) -> str:
    """The query that ranks the rows of `scope` (SQL selecting `id` and a tsvector `v` in `RANK_TS_CONFIG`),
    for `score`. Both common table expressions are materialized: computed once, not once per row (a
    prepared statement's generic plan did that: 0.8 s)."""
    return (f"WITH scope AS MATERIALIZED ({scope}), "
            "stats AS MATERIALIZED (SELECT count(*) AS n, coalesce(avg(length(v)), 0) AS avgdl FROM scope) "
            "SELECT s.id, length(s.v), ts_filter(setweight(s.v, 'A', CAST(:lexemes AS text[])), '{a}')::text, "
            "stats.n, stats.avgdl FROM scope AS s, stats WHERE s.v @@ CAST(:tsquery AS tsquery)")


def ranking_params(terms: Terms) -> dict[str, object]:
    return {"lexemes": terms.lexemes, "tsquery": terms.tsquery()}


def term_counts(hits: str, terms: Terms) -> dict[object, int]:
    """How often each of `terms` occurs in one row, from ts_filter's text output ('word':3A,17A ...): a
    single term by its positions' count, a phrase by its second lexeme's positions right after the first's."""
    found = {}
    for entry in hits.split(" ") if hits else ():
        lexeme, _, at = entry.rpartition(":")  # positions hold no colon; a lexeme may
        found[lexeme[1:-1].replace("''", "'")] = at
    tf: dict[object, int] = {x: found[x].count(",") + 1 for x in terms.singles if x in found}
    sets: dict[str, set[int]] = {}
    for a, b in terms.phrases:
        if a in found and b in found:
            for x in (a, b):
                if x not in sets:
                    sets[x] = {int(p.rstrip("ABCD")) for p in found[x].split(",")}
            count = sum(1 for p in sets[b] if p - 1 in sets[a])
            if count:
                tf[(a, b)] = count
    return tf


def score(rows: list[tuple], terms: Terms, limit: int) -> list:
    """The ids of `ranking_sql`'s rows, best BM25 first (ties by id), at most `limit`."""
    if not rows:
        return []
    n, avgdl = rows[0][3], float(rows[0][4]) or 1.0
    docs = [(row_id, length, term_counts(hits, terms)) for row_id, length, hits, _, _ in rows]
    df: dict[object, int] = {}
    for _, _, tf in docs:
        for term in tf:
            df[term] = df.get(term, 0) + 1
    idf = {t: max(_MIN_IDF, math.log((n - d + 0.5) / (d + 0.5))) for t, d in df.items()}
    scored = []
    for row_id, length, tf in docs:
        norm = K1 * (1 - B + B * length / avgdl)
        s = sum((PHRASE_WEIGHT if isinstance(t, tuple) else 1.0) * idf[t] * f * (K1 + 1) / (f + norm)
                for t, f in tf.items())
        if s > 0:
            scored.append((-s, row_id))
    scored.sort()
    return [row_id for _, row_id in scored[:limit]]
