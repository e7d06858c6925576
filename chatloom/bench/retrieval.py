"""`chatloom bench retrieval`: how well, and how fast, retrieval over uploaded files finds the passage
that answers a question.

The corpus is chatloom's own documentation (docs/*.md), uploaded through the product's own path
(extraction, passages, their embeddings by `files.embedding_model`, the full-text index), into a fresh
SQLite database. The questions (texts/retrieval_questions.jsonl, committed with the bench) each name the page that
answers them and a phrase of the answer; a retrieved passage is relevant when it is from that page and
holds the phrase (so the set does not depend on where passages are cut). Recall@k is the fraction of
questions with a relevant passage in the top k, for full-text search alone, vector search alone, and
the two fused by reciprocal rank (what the chat uses). `top_k_spread` says how varied each ranking's
top k is over the questions: vectors that show every question the same few passages (hubs) find
nothing, however the search itself works.

Latency: retrieval runs before an answer's first token, so what it adds to TTFT is what the chat does
for a new message (`Retriever.for_conversation`): find the files the conversation reads, search them,
read the passages and fit them to the prompt budget. It is timed over a conversation reading a
collection of `latency_chunks` passages (the corpus's passages again, with random unit vectors), each
question once, as the default settings run it (full-text only) and with embeddings on (hybrid, the
question's embedding included), with the parts beside them: the full-text search alone and the
question's embedding alone (by the static model in the gateway, or through a served model's quota,
admission and metering), and a bare `SELECT 1` through the
same pool, the floor any database work has on the machine. The parts are alternated per
question, so a busy moment of a shared machine lands on each alike.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

QUESTIONS = Path(__file__).parent / "texts" / "retrieval_questions.jsonl"
DOCS = Path(__file__).resolve().parents[2] / "docs"
MODES = ("fulltext", "vector", "hybrid")


def load_questions(path: Path = QUESTIONS, limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def run_retrieval(loaded, k: int = 5, limit: int | None = None, latency_chunks: int = 1000,
                  docs_dir: Path = DOCS, chunk_chars: int | None = None, overlap: int | None = None,
                  pooling: str = "last", modes: tuple[str, ...] = MODES, db_url: str | None = None,
                  embedding_model: str | None = None, vector_weight: float | None = None) -> dict:
    """The bench's report; `chunk_chars`, `overlap` and `embedding_model` default to the files settings'
    defaults (`embedding_model`: the static embedding model, or a served model's name such as
    `loaded.id`; `vector_weight`: the fusion's weight of the vector ranking, default its default for
    that embedder). `modes` without "vector" and "hybrid" indexes no vectors (fast: no model work); `db_url`:
    an empty database to index into (default: a fresh SQLite file)."""
    from chatloom.settings.tree import FilesSettings

    defaults = FilesSettings()
    chunk_chars = chunk_chars if chunk_chars is not None else defaults.chunk_chars
    overlap = overlap if overlap is not None else defaults.chunk_overlap_chars
    embedding_model = embedding_model or defaults.embedding_model
    with tempfile.TemporaryDirectory(prefix="chatloom-bench-retrieval-") as data_dir:
        return asyncio.run(_run(loaded, k, load_questions(limit=limit), latency_chunks, docs_dir, data_dir,
                                chunk_chars, overlap, pooling, tuple(m for m in MODES if m in modes), db_url,
                                embedding_model, vector_weight))


async def _run(loaded, k: int, questions: list[dict], latency_chunks: int, docs_dir: Path, data_dir: str,
               chunk_chars: int, overlap: int, pooling: str, modes: tuple[str, ...], db_url: str | None,
               embedding_model: str, vector_weight: float | None) -> dict:
    from chatloom.app.main import create_app
    from chatloom.engine import EngineConfig
    from chatloom.models.static_embeddings import is_static, load_static_embedder
    from chatloom.serving import LocalBackend
    from chatloom.settings import Settings
    from chatloom.store import Users

    vectors = "vector" in modes or "hybrid" in modes
    if vectors and is_static(embedding_model):
        load_static_embedder(embedding_model)  # a missing package stops the bench here, saying what to install
    settings = Settings(server={"data_dir": data_dir, "db_url": db_url},
                        accounts={"jwt_secret": "bench-secret-0123456789abcdef0123456789abcdef",
                                  "argon2_time_cost": 1, "argon2_memory_kib": 1024},
                        files={"embeddings": vectors, "chunk_chars": chunk_chars, "chunk_overlap_chars": overlap,
                               "top_k": k, "max_user_bytes": 1_000_000_000, "embedding_model": embedding_model,
                               "vector_weight": vector_weight})
    backend = LocalBackend(loaded, engine_config=EngineConfig(num_blocks=2048, max_num_batched_tokens=1024),
                           pooling=pooling)
    await backend.start()
    app = create_app(settings, backend)
    try:
        async with app.router.lifespan_context(app):
            ctx = app.state.ctx
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
                for name in ("reader", "latency"):
                    r = await client.post("/auth/signup", json={"username": name, "password": "correct horse"})
                    r.raise_for_status()
            async with ctx.db.session() as session:
                # The pro tier: its per-minute limits hold the bench's hundreds of embeddings requests (a
                # refused question embedding would silently leave a search without vectors).
                reader = await Users(session).set_tier("reader", "pro")
                other = await Users(session).set_tier("latency", "pro")
                await session.commit()
            t0 = time.perf_counter()
            files = {}
            for path in sorted(docs_dir.glob("*.md")):
                row = await ctx.files.upload(reader, path.name, path.read_bytes())
                files[row.id] = path.name
            index_s = time.perf_counter() - t0
            passages = await _passages(ctx)
            recall, misses, stale, spread = await _recall(ctx, reader, files, passages, questions, k, modes)
            latency = await _latency(ctx, other, passages, questions, latency_chunks, vectors)
            vector_search = ctx.db.vector_search or "exact"
    finally:
        await backend.close()
    return {"benchmark": "retrieval", "model": loaded.id, "embedding_model": embedding_model if vectors else None,
            "vector_weight": settings.files.fusion_weight() if vectors else None, "database": "sqlite" if db_url is None else
            db_url.split(":", 1)[0].split("+", 1)[0], "vector_search": vector_search, "pooling": pooling, "k": k,
            "questions": len(questions),
            "stale_questions": stale, "documents": len(files), "passages": len(passages),
            "chunk_chars": chunk_chars, "chunk_overlap_chars": overlap, "index_s": round(index_s, 2),
            f"recall_at_{k}": recall, "top_k_spread": spread, "missed": misses, "latency": latency}


async def _passages(ctx) -> dict[int, tuple[str, str]]:
    """Every indexed passage of the corpus: id -> (file id, text)."""
    from sqlalchemy import select

    from chatloom.store.file_chunks import FileChunk

    async with ctx.db.session() as session:
        rows = (await session.execute(select(FileChunk.id, FileChunk.file_id, FileChunk.text))).all()
    return {i: (f, t) for i, f, t in rows}


async def _recall(ctx, user, files: dict[str, str], passages: dict, questions: list[dict], k: int,
                  modes: tuple[str, ...]):
    hits = {m: 0 for m in modes}
    misses: dict[str, list[str]] = {m: [] for m in modes}
    shown: dict[str, Counter] = {m: Counter() for m in modes}  # how many questions' top k hold each passage
    stale = 0
    ids = list(files)
    for q in questions:
        answer = _norm(q["answer"])
        relevant = {i for i, (f, text) in passages.items() if files[f] == q["doc"] and answer in _norm(text)}
        if not relevant:  # the docs changed under the question: say so, do not count it
            stale += 1
            continue
        for mode in modes:
            found = await ctx.retriever.search(user, ids, q["question"], mode, k)
            shown[mode].update(set(found))
            if relevant & set(found):
                hits[mode] += 1
            else:
                misses[mode].append(q["question"])
    counted = len(questions) - stale
    recall = {m: round(hits[m] / counted, 3) if counted else None for m in modes}
    return recall, {m: v[:10] for m, v in misses.items()}, stale, {m: _spread(shown[m], counted) for m in modes}


def _spread(shown: Counter, questions: int) -> dict:
    """How varied a ranking's top k is over the questions: distinct passages shown, and the share of
    questions whose top k holds the most shown one. A ranking that shows the same few passages to every
    question (hubs: vectors that all lie near a few passages) finds nothing however good the rest is."""
    top = shown.most_common(1)
    return {"distinct_passages": len(shown), "most_shown_share": round(top[0][1] / questions, 3) if top and questions
            else None}


async def _latency(ctx, user, passages: dict, questions: list[dict], size: int, vectors: bool) -> dict:
    """What retrieval adds before an answer, per question, over a conversation reading `size` passages of
    the user's own (texts of the corpus, random unit vectors of the embedder's width, under its name): the
    chat's retrieval with full-text search alone and with embeddings on (hybrid), and their parts."""
    from sqlalchemy import select, text

    from chatloom.app.files.search import pack
    from chatloom.store import Conversations
    from chatloom.store.file_chunks import ConversationFile, FileChunk
    from chatloom.store.models import StoredFile, new_id
    from chatloom.store.vector_index import PGVECTOR, write_pg_vectors

    if size <= 0 or not passages:
        return {}
    rng = np.random.default_rng(0)
    texts = [t for _, t in passages.values()]
    embed_as = ctx.settings.files.embedding_model
    model, width = ctx.backend.default_model, None
    if vectors:  # the width and the name its vectors are stored under, from the embedder itself
        model, probe = await ctx.files.embedder.embed(user, ["width"], embed_as)
        width = len(probe.vectors[0])
    width = width or 64
    file_id = new_id("file")
    async with ctx.db.session() as session:
        session.add(StoredFile(id=file_id, user_id=user.id, filename="latency.md", purpose="user_data",
                               content_type="text/markdown", bytes=0, blob_key=f"{user.id}/{file_id}",
                               status="processed"))
        conv = await Conversations(session).create(user.id, "latency")
        await session.flush()
        session.add(ConversationFile(conversation_id=conv.id, file_id=file_id))
        for i in range(size):
            v = rng.standard_normal(width).astype(np.float32)
            session.add(FileChunk(file_id=file_id, user_id=user.id, ordinal=i, text=texts[i % len(texts)],
                                  char_start=0, char_end=0, embedding=pack((v / np.linalg.norm(v)).tolist()),
                                  embedding_model=model))
        await session.flush()
        if ctx.db.vector_search == PGVECTOR:  # pgvector's column, as an upload writes it
            rows = await session.execute(select(FileChunk.id, FileChunk.embedding).where(FileChunk.file_id == file_id))
            await write_pg_vectors(session, [tuple(r) for r in rows])
        await session.commit()
        conversation_id = conv.id
    retriever = ctx.retriever
    await retriever.for_conversation(user, conversation_id, "warm up", mode="hybrid")
    # The floor: one trivial query through a session of the same pool, what any database work costs here.
    parts: dict[str, list[float]] = {"chat_default": [], "fulltext": [], "select_1": []}
    if vectors:
        parts.update(chat_hybrid=[], question_embedding=[])
    for q in questions:
        for part in parts:
            t0 = time.perf_counter()
            if part == "question_embedding":
                await ctx.files.embedder.embed(user, [q["question"]], embed_as)
            elif part == "fulltext":
                await retriever.search(user, [file_id], q["question"], "fulltext")
            elif part == "select_1":
                async with ctx.db.session() as session:
                    await session.execute(text("SELECT 1"))
            else:
                await retriever.for_conversation(user, conversation_id, q["question"],
                                                 mode="fulltext" if part == "chat_default" else "hybrid")
            parts[part].append((time.perf_counter() - t0) * 1000)
    out: dict = {"passages": size, "searches": len(questions)}
    for part, times in parts.items():
        times.sort()
        out[part] = {"p50_ms": round(statistics.median(times), 2), "p90_ms": round(_p90(times), 2),
                     "max_ms": round(times[-1], 2)}
    return out


def _p90(ordered: list[float]) -> float:
    """The 90th percentile of sorted values (nearest rank)."""
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
