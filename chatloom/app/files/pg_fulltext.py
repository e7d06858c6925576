"""BM25 over PostgreSQL's tsvectors, with phrases: the ranking SQLite's FTS5 gives, on PostgreSQL.

`ts_rank` weighs every word alike (no document frequency) and does not saturate a word repeated, so a
passage saying "token" ten times outranked the one saying "session token" once. Here the database does
what only it can do cheaply, in one statement: stem the question's words, find the passages in scope
holding any of its terms, and hand back, per passage, only the question's lexemes with their positions
(`setweight` marks them, `ts_filter` keeps them: no text parsed again), with the scope's size and mean
length, and the terms themselves as lexemes. Python then scores BM25 as FTS5 does (k1 = 1.2, b = 0.75, a
phrase a term of its own, counted where its two lexemes stand side by side, at `PHRASE_WEIGHT`), with
document frequencies over the scope: the user's own passages (or one conversation's messages), never
anyone else's.

The tsvectors are of `RANK_TS_CONFIG` (English stems, stop words kept for phrases such as "not exist")
over the text split at every character that is not a letter or digit, as FTS5's tokenizer splits it
(store/file_chunks.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from chatloom.app.files.query import PHRASE_WEIGHT
from chatloom.store.file_chunks import RANK_TS_CONFIG

K1 = 1.2
B = 0.75
_MIN_IDF = 1e-6  # FTS5's floor for a term in more than half the rows


@dataclass(frozen=True)
class Terms:
    """What a question is ranked by, as lexemes: single terms and adjacent pairs."""

    singles: tuple[str, ...]
    phrases: tuple[tuple[str, str], ...]


# Lexemes are letters and digits (the words are), so quoting them is all tsquery's syntax needs.
_QUOTED_A, _QUOTED_B = "(chr(39) || a || chr(39))", "(chr(39) || b || chr(39))"
_TSQUERY = (f"CAST(string_agg(CASE WHEN b = '' THEN {_QUOTED_A} ELSE {_QUOTED_A} || ' <-> ' || {_QUOTED_B} END, "
            "' | ') AS tsquery)")


def ranking_sql(scope: str) -> str:
    """The statement that ranks the rows of `scope` (SQL selecting `id` and a tsvector `v` in
    `RANK_TS_CONFIG`) for `ranking_params`' words, for `split` and `score`. Each word is stemmed here (a
    word with no lexeme, or several, joins no phrase) and the terms come back as rows without an id, so
    one round trip does it all. Each passage's tsvector is read once, marking the question's lexemes:
    reading it for the scope's statistics, the match and the positions apart took three reads of its
    TOAST. The common table expressions are materialized: computed once, not once per row (a prepared
    statement's generic plan did that: 0.8 s)."""
    return (
        f"WITH words AS MATERIALIZED (SELECT w, tsvector_to_array(to_tsvector('{RANK_TS_CONFIG}', w)) AS l "
        "FROM unnest(CAST(:words AS text[])) AS t(w)), "
        "terms AS MATERIALIZED ("
        "SELECT x AS a, '' AS b FROM words, unnest(words.l) AS x WHERE words.w = ANY(CAST(:singles AS text[])) "
        "UNION SELECT wa.l[1], wb.l[1] FROM unnest(CAST(:firsts AS text[]), CAST(:seconds AS text[])) AS p(a, b) "
        "JOIN words AS wa ON wa.w = p.a JOIN words AS wb ON wb.w = p.b "
        "WHERE cardinality(wa.l) = 1 AND cardinality(wb.l) = 1), "
        f"q AS MATERIALIZED (SELECT {_TSQUERY} AS tq, "
        "array_agg(a) || array_agg(b) FILTER (WHERE b <> '') AS lx FROM terms), "
        f"scope AS MATERIALIZED (SELECT s0.id, setweight(s0.v, 'A', q.lx) AS v FROM ({scope}) AS s0, q), "
        "stats AS MATERIALIZED (SELECT count(*) AS n, coalesce(avg(length(v)), 0) AS avgdl FROM scope) "
        "SELECT s.id, length(s.v), ts_filter(s.v, '{a}')::text, stats.n, stats.avgdl "
        "FROM scope AS s, stats, q WHERE s.v @@ q.tq "
        "UNION ALL SELECT NULL, NULL, a || ' ' || b, NULL, NULL FROM terms")


def ranking_params(words: list[str], phrases: list[tuple[str, str]]) -> dict[str, object]:
    """`ranking_sql`'s parameters for `query_terms`' content words and adjacent pairs."""
    return {"words": list(dict.fromkeys([*words, *(w for p in phrases for w in p)])), "singles": list(words),
            "firsts": [a for a, _ in phrases], "seconds": [b for _, b in phrases]}


def split(rows: list[tuple]) -> tuple[list[tuple], Terms]:
    """`ranking_sql`'s rows as the matching rows and the question's terms."""
    hits, singles, phrases = [], [], []
    for row in rows:
        if row[0] is not None:
            hits.append(row)
            continue
        a, _, b = row[2].partition(" ")
        if b:
            phrases.append((a, b))
        else:
            singles.append(a)
    return hits, Terms(tuple(singles), tuple(phrases))


def _quoted(lexeme: str) -> str:
    """A lexeme as ts_filter's text output writes it."""
    return "'" + lexeme.replace("'", "''") + "'"


@dataclass(frozen=True)
class Lookup:
    """A question's terms by their lexemes as ts_filter's text output writes them: made once per question,
    so each row costs only its own few lexemes (a row holds some of the question's, rarely all)."""

    singles: dict[str, str]  # quoted lexeme -> the term
    phrases: dict[str, tuple[tuple[tuple[str, str], str], ...]]  # quoted first lexeme -> (phrase, quoted second)

    @classmethod
    def of(cls, terms: Terms) -> "Lookup":
        phrases: dict[str, list] = {}
        for pair in terms.phrases:
            phrases.setdefault(_quoted(pair[0]), []).append((pair, _quoted(pair[1])))
        return cls({_quoted(x): x for x in terms.singles}, {k: tuple(v) for k, v in phrases.items()})


def term_counts(hits: str, terms: Terms, lookup: Lookup | None = None) -> dict[object, int]:
    """How often each of `terms` occurs in one row, from ts_filter's text output ('word':3A,17A ...): a
    single term by its positions' count, a phrase by its second lexeme's positions right after the first's.
    `lookup`: `Lookup.of(terms)`, made once per question."""
    if not hits:
        return {}
    lookup = lookup or Lookup.of(terms)
    # Every position is weight A (setweight marked only the question's lexemes, ts_filter kept them) and
    # lexemes are lower case, so dropping the letters leaves plain numbers.
    found = {}
    tf: dict[object, int] = {}
    for entry in hits.replace("A", "").split(" "):
        lexeme, _, at = entry.rpartition(":")  # positions hold no colon; a lexeme may
        found[lexeme] = at
        term = lookup.singles.get(lexeme)
        if term is not None:
            tf[term] = at.count(",") + 1
    for lexeme, at in found.items():
        for pair, second in lookup.phrases.get(lexeme, ()):
            then = found.get(second)
            if then is None:
                continue
            after = set(map(int, then.split(",")))
            count = sum(1 for p in map(int, at.split(",")) if p + 1 in after)
            if count:
                tf[pair] = count
    return tf


def score(rows: list[tuple], terms: Terms, limit: int) -> list:
    """The ids of `ranking_sql`'s rows, best BM25 first (ties by id), at most `limit`."""
    if not rows:
        return []
    n, avgdl = rows[0][3], float(rows[0][4]) or 1.0
    lookup = Lookup.of(terms)
    docs = [(row_id, length, term_counts(hits, terms, lookup)) for row_id, length, hits, _, _ in rows]
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
