"""A question as full-text search sees it: its words, its content words and its adjacent-word phrases.

Both databases search by the same terms (search.py, pg_fulltext.py): an OR of the question's content
words (function words dropped, so "what" and "the" neither match every passage nor weigh in the ranking)
and of each pair of adjacent words as a phrase, function words included ("not exist", "per block").

A phrase counts at `PHRASE_WEIGHT` of a word: its two words are already scored on their own, so at full
weight a passage holding the pair was paid for the same words twice, and a pair of common words ("the
model", "per block") outranked the one rare word that answers the question. BM25 sums one score per term,
so the words and the phrases can be scored apart and added with their weights, as the sequential
dependence model of Metzler and Croft weighs word pairs below words.
"""
from __future__ import annotations

import re

_WORD = re.compile(r"[^\W_]+", re.UNICODE)
MAX_TERMS = 32
MAX_PHRASES = 24
# A phrase's BM25 score counts this much of a word's (docs/files.md has the sweep).
PHRASE_WEIGHT = 0.5

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
    """The OR query of `query_terms` in FTS5's syntax: quoted words and phrases ("" without words). The
    words are letters and digits only, so nothing in them is taken as syntax."""
    return " OR ".join(q for q, _ in fts5_parts(query))


def fts5_parts(query: str) -> list[tuple[str, float]]:
    """`query_terms` as FTS5 queries to score apart, each with the weight of its BM25 score: the words'
    OR query (1), and the phrases' (`PHRASE_WEIGHT`); a part without terms is left out. FTS5's BM25
    scores each phrase as a term of its own, so a rare phrase weighs as a rare word does, times its weight."""
    words, phrases = query_terms(query)
    parts = [(" OR ".join(f'"{w}"' for w in words), 1.0),
             (" OR ".join(f'"{a} {b}"' for a, b in phrases), PHRASE_WEIGHT)]
    return [(q, weight) for q, weight in parts if q]
