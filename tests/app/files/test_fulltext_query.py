"""The full-text query of a question: content words and adjacent pairs as phrases, ranked alike by
SQLite's FTS5 and PostgreSQL's tsvector."""
from __future__ import annotations

import pytest

from app_testing import make_settings
from chatloom.app.files.search import fts5_query, query_terms

FILLER = "Unrelated filler about gardens and weather. " * 30


@pytest.fixture
def settings(tmp_path, db_url):
    return make_settings(tmp_path, server={"db_url": db_url}, files={"chunk_chars": 400, "chunk_overlap_chars": 0})


def test_function_words_leave_the_terms_but_join_the_phrases():
    words, phrases = query_terms("How long does a session token stay valid?")
    assert words == ["long", "session", "token", "stay", "valid"]
    assert ("session", "token") in phrases and ("how", "long") in phrases
    assert fts5_query("What is it?") == '"what" OR "is" OR "it" OR "what is" OR "is it"'  # nothing but function words
    assert fts5_query("?!") == ""


async def test_a_passage_with_the_phrase_outranks_one_with_the_words_apart(client, alice):
    # As many of each word apart as together, the passage apart the shorter: without the phrase, it would
    # rank first.
    apart = "Every session begins at login and each session ends. Every token is counted and each token is metered."
    together = ("The session token is kept in the browser's storage until it expires, and a new session token "
                "replaces it at the next login of the same user on that browser.")
    doc = f"{apart}\n\n{FILLER}\n\n{together}\n\n{FILLER}\n"
    r = await client.post("/files", headers=alice, files={"file": ("notes.txt", doc.encode())})
    assert r.status_code == 201, r.text
    found = (await client.get("/files/search", headers=alice, params={"q": "what is a session token?",
                                                                     "mode": "fulltext"})).json()
    assert [("session token is kept" in p["text"], "session begins" in p["text"]) for p in found[:2]] == [
        (True, False), (False, True)], found
    # Function words alone match nothing of substance: "the" and "is" are in every passage.
    only_filler = (await client.get("/files/search", headers=alice, params={"q": "what about the weather",
                                                                           "mode": "fulltext"})).json()
    assert only_filler and all("weather" in p["text"] for p in only_filler)



async def test_a_word_inside_a_path_is_found(client, alice):
    # Both databases split text at every character that is not a letter or digit, as the question's words
    # are split: "/v1/embeddings" holds "embeddings" (PostgreSQL's parser alone keeps it one path token).
    doc = f"{FILLER}\n\nVectors are made by POST /v1/embeddings on the gateway.\n\n{FILLER}\n"
    r = await client.post("/files", headers=alice, files={"file": ("ops.txt", doc.encode())})
    assert r.status_code == 201, r.text
    found = (await client.get("/files/search", headers=alice, params={"q": "which path serves embeddings?",
                                                                     "mode": "fulltext"})).json()
    assert found and "/v1/embeddings" in found[0]["text"], found



def test_postgres_bm25_counts_words_and_adjacent_phrases():
    from chatloom.app.files.pg_fulltext import Terms, score, term_counts

    terms = Terms(singles=("session", "token"), phrases=(("session", "token"), ("not", "exist")))
    # ts_filter's output: 'session' at 3 and 9, 'token' at 4 and 20, 'not' at 7, 'exist' at 9.
    hits = "'exist':9A 'not':7A 'session':3A,9A 'token':4A,20A"
    assert term_counts(hits, terms) == {"session": 2, "token": 2, ("session", "token"): 1}
    assert term_counts("'exist':8A 'not':7A", terms) == {("not", "exist"): 1}
    assert term_counts("", terms) == {}
    # Rows: id, distinct lexemes, hits, scope size, mean length. The rare phrase outweighs a common word
    # said often; a row with none of the terms scores nothing.
    rows = [(1, 50, "'token':1A,5A,9A,13A,17A", 10, 50.0), (2, 50, "'session':3A 'token':4A", 10, 50.0),
            (3, 50, "'token':2A", 10, 50.0), (4, 50, "", 10, 50.0)]
    assert score(rows, terms, 10) == [2, 1, 3]


async def test_a_phrase_counts_less_than_a_word(client, alice):
    # The question's words stand apart in the answer; the other passage holds one word of the question and
    # three of its adjacent pairs ("how does", "does the", "the proxy"). At a word's weight those three
    # phrases outrank the two words that answer it; at half, they do not.
    wrong = "How does the proxy start? It reads its configuration file once."
    right = "An upstream that keeps failing is treated as down until a check passes."
    doc = f"{wrong}\n\n{FILLER}\n\n{right}\n\n{FILLER}\n"
    r = await client.post("/files", headers=alice, files={"file": ("proxy.txt", doc.encode())})
    assert r.status_code == 201, r.text
    found = (await client.get("/files/search", headers=alice, params={"q": "How does the proxy treat a failing upstream?",
                                                                     "mode": "fulltext"})).json()
    assert [("keeps failing" in p["text"], "proxy start" in p["text"]) for p in found[:2]] == [
        (True, False), (False, True)], found


async def test_sqlite_runs_the_full_text_query_once_not_once_per_passage(app):
    """The planner must start from the FTS5 index and look each hit's passage up by id: started from the
    user's passages (their user_id index), it reruns the MATCH per passage, 0.4 s for 1,000 of them."""
    from sqlalchemy import bindparam, text

    from chatloom.app.files.search import _SQLITE_FULLTEXT

    db = app.state.ctx.db
    if not db.is_sqlite:
        pytest.skip("an SQLite plan")
    sql = "EXPLAIN QUERY PLAN " + _SQLITE_FULLTEXT.format(weight=1.0, q="q0")
    async with db.session() as session:
        plan = [row[-1] for row in (await session.execute(text(sql).bindparams(
            bindparam("files", expanding=True)), {"q0": "token", "user": "u", "files": ["f"]})).all()]
    assert plan[0].startswith("SCAN file_chunks_fts") and plan[1].startswith("SEARCH c USING INTEGER PRIMARY KEY"), plan
