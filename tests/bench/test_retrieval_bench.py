"""`chatloom bench retrieval` end to end on the tiny model, and its question set against the docs."""
from __future__ import annotations

import importlib.util
import re

import pytest

from chatloom.bench.retrieval import DOCS, load_questions, run_retrieval
from chatloom.settings.tree import DEFAULT_EMBEDDING_MODEL, STATIC_VECTOR_WEIGHT


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def test_the_question_set_is_large_and_every_answer_is_in_its_page():
    questions = load_questions()
    assert len(questions) >= 100
    assert len({q["question"] for q in questions}) == len(questions)
    for q in questions:
        page = DOCS / q["doc"]
        assert page.exists(), q
        assert _norm(q["answer"]) in _norm(page.read_text(encoding="utf-8")), q


def test_bench_reports_recall_per_mode_and_latency(tiny_model_fp32):
    # Embedded by the served tiny model: the path of a served model as the embedder.
    r = run_retrieval(tiny_model_fp32, k=5, limit=12, latency_chunks=60, embedding_model="tiny-random")
    assert r["embedding_model"] == "tiny-random" and r["vector_weight"] == 1.0
    assert r["questions"] == 12 and r["stale_questions"] == 0 and r["documents"] >= 20
    recall = r["recall_at_5"]
    assert set(recall) == {"fulltext", "vector", "hybrid"}
    # The random model's vectors carry no meaning, but the words do: full-text finds most answers,
    # and fusing in meaningless vectors costs it little.
    assert recall["fulltext"] >= 0.5 and recall["hybrid"] >= recall["fulltext"] - 0.25
    # How varied each ranking's top 5 is: full-text shows different passages to different questions.
    spread = r["top_k_spread"]
    assert set(spread) == set(recall)
    for mode, s in spread.items():
        assert 5 <= s["distinct_passages"] <= 12 * 5 and 0 < s["most_shown_share"] <= 1, (mode, s)
    assert spread["fulltext"]["distinct_passages"] > 15 and spread["fulltext"]["most_shown_share"] < 0.5
    latency = r["latency"]
    assert latency["passages"] == 60 and latency["searches"] == 12
    parts = ("chat_default", "chat_hybrid", "fulltext", "question_embedding", "select_1")
    assert all(0 < latency[part]["p50_ms"] <= latency[part]["p90_ms"] for part in parts)


def test_bench_of_fulltext_alone_indexes_no_vectors(tiny_model_fp32):
    r = run_retrieval(tiny_model_fp32, k=5, limit=8, latency_chunks=40, modes=("fulltext",))
    assert set(r["recall_at_5"]) == {"fulltext"} and r["recall_at_5"]["fulltext"] >= 0.5
    assert set(r["latency"]) == {"passages", "searches", "chat_default", "fulltext", "select_1"}


@pytest.mark.skipif(importlib.util.find_spec("wordllama") is None,
                    reason="needs the wordllama package: pip install --no-deps wordllama==0.4.0.post1")
def test_bench_uses_the_static_embedding_model_by_default(tiny_model_fp32):
    r = run_retrieval(tiny_model_fp32, k=5, limit=12, latency_chunks=40)
    assert r["embedding_model"] == DEFAULT_EMBEDDING_MODEL and r["vector_weight"] == STATIC_VECTOR_WEIGHT
    recall = r["recall_at_5"]
    # Its vectors find answers by meaning; at its fusion weight they cost full-text search little.
    assert recall["vector"] >= 0.25 and recall["hybrid"] >= recall["fulltext"] - 0.1
    assert r["latency"]["question_embedding"]["p50_ms"] < 5
