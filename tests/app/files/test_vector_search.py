"""Vector search in the database's extension (pgvector, sqlite-vec) where installed, and the exact search in
numpy otherwise: the same passages in the same order, over the asking user's passages only."""
from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import select, text

from chatloom.app.files.search import nearest, pack
from chatloom.store import Users
from chatloom.store.file_chunks import FileChunk
from chatloom.store.models import StoredFile, new_id
from chatloom.store.vector_index import PGVECTOR, write_pg_vectors

WIDTH = 48


def unit(rng, n: int) -> np.ndarray:
    v = rng.standard_normal((n, WIDTH)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


async def add_passages(db, user_id: str, vectors: np.ndarray, model: str = "m") -> str:
    file_id = new_id("file")
    async with db.session() as session:
        session.add(StoredFile(id=file_id, user_id=user_id, filename="v.md", purpose="user_data",
                               content_type="text/markdown", bytes=0, blob_key=f"{user_id}/{file_id}",
                               status="processed"))
        await session.flush()
        chunks = [FileChunk(file_id=file_id, user_id=user_id, ordinal=i, text=f"passage {i}", char_start=0,
                            char_end=0, embedding=pack(v.tolist()), embedding_model=model)
                  for i, v in enumerate(vectors)]
        session.add_all(chunks)
        await session.flush()
        if db.vector_search == PGVECTOR:
            await write_pg_vectors(session, [(c.id, c.embedding) for c in chunks])
        await session.commit()
        return file_id


async def user(db, name: str) -> str:
    async with db.session() as session:
        row = await Users(session).create(name, "x" * 20)
        await session.commit()
        return row.id


@pytest.fixture
async def db(app):
    return app.state.ctx.db


async def extension_offered(db) -> bool:
    """Whether this database could do vector search itself: pgvector installed on the server, or
    sqlite-vec loadable by this Python's sqlite3."""
    if db.is_sqlite:
        import sqlite3
        return hasattr(sqlite3.Connection, "enable_load_extension")
    async with db.engine.connect() as conn:
        return (await conn.execute(text("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'"))).first() \
            is not None


async def test_the_extension_is_used_where_installed(db):
    if not await extension_offered(db):
        pytest.skip("neither pgvector on this server nor extension loading in this Python's sqlite3")
    assert db.vector_search == ("sqlite-vec" if db.is_sqlite else "pgvector")


async def test_extension_and_exact_search_agree_on_the_users_own_passages(db):
    rng = np.random.default_rng(7)
    alice, bob = await user(db, "alice"), await user(db, "bob")
    mine = [await add_passages(db, alice, unit(rng, 150)), await add_passages(db, alice, unit(rng, 50))]
    theirs = await add_passages(db, bob, unit(rng, 200))
    other_model = await add_passages(db, alice, unit(rng, 20), model="other")
    async with db.session() as session:
        ids = {fid: set((await session.scalars(select(FileChunk.id).where(FileChunk.file_id == fid))).all())
               for fid in [*mine, theirs, other_model]}
        matrix = {i: np.frombuffer(e, "<f4") for i, e in (await session.execute(
            select(FileChunk.id, FileChunk.embedding).where(FileChunk.file_id.in_(mine)))).all()}
        for q in unit(rng, 25):
            exact = await nearest(session, alice, mine + [theirs, other_model], q.tolist(), "m", 20, None)
            # Only the asker's passages of the asked model, best cosine first.
            expected = sorted(matrix, key=lambda i: (-float(matrix[i] @ q), i))[:20]
            assert exact == expected
            assert set(exact) <= ids[mine[0]] | ids[mine[1]]
            if db.vector_search is not None:
                inside = await nearest(session, alice, mine + [theirs, other_model], q.tolist(), "m", 20,
                                       db.vector_search)
                assert inside == exact
        # Another user's files ask nothing of the asker's passages, and theirs never come back.
        assert await nearest(session, bob, mine, unit(rng, 1)[0].tolist(), "m", 5, db.vector_search) == []


async def test_deleting_a_file_removes_its_vectors(client, app, db):
    from app_testing import signup

    alice = await signup(client, "carol")
    r = await client.post("/files", headers=alice, files={"file": ("a.md", b"# Notes\n\nSome words to embed.\n")})
    assert r.status_code == 201, r.text
    async with db.engine.connect() as conn:
        column = "embedding_vec" if db.vector_search == PGVECTOR else "embedding"
        before = (await conn.execute(text(f"SELECT count({column}) FROM file_chunks"))).scalar()
    assert before > 0
    assert (await client.delete(f"/files/{r.json()['id']}", headers=alice)).status_code == 204
    async with db.engine.connect() as conn:
        assert (await conn.execute(text(f"SELECT count({column}) FROM file_chunks"))).scalar() == 0


async def test_a_passage_asked_for_by_its_own_text_comes_first(client, app, db):
    """Through the product's whole path (the engine's vectors for passages and for the question, stored,
    read back and ranked): every passage is the nearest to itself, and the vectors of different passages
    differ. Vectors stored in another order, width or byte order than they are read, passages and questions
    pooled differently, or a distance sorted the wrong way round all break it."""
    from app_testing import signup

    alice = await signup(client, "dora")
    words = ["llamas graze", "ships sail", "kernels compile", "tokens stream", "quotas refill", "blobs persist"]
    body = "\n\n".join(f"# Part {i}\n\n" + " ".join([w] * 60) + "." for i, w in enumerate(words))
    r = await client.post("/files", headers=alice, files={"file": ("parts.md", body.encode())})
    assert r.status_code == 201 and r.json()["status_details"] is None, r.text
    passages = (await client.get(f"/files/{r.json()['id']}/passages", headers=alice)).json()
    assert len(passages) >= 4
    async with db.session() as session:
        vectors = {v for (v,) in (await session.execute(
            select(FileChunk.embedding).where(FileChunk.file_id == r.json()["id"]))).all()}
    assert len(vectors) == len(passages)
    for p in passages:
        found = (await client.get("/files/search", headers=alice, params={"q": p["text"], "mode": "vector"})).json()
        assert found[0]["text"] == p["text"], (p["ordinal"], [f["ordinal"] for f in found])


def test_fusion_weighs_the_vector_ranking():
    from chatloom.app.files.search import fuse

    words, vectors = [1, 2, 3, 4], [9, 8, 1, 7]
    assert fuse([words, vectors], 60)[:4] == [1, 9, 2, 8]  # plain RRF: the two interleave
    assert fuse([words, vectors], 60, [1.0, 0.2])[:4] == [1, 2, 3, 4]  # weak vectors only break ties
    assert fuse([words, vectors], 60, [1.0, 0.0]) == [1, 2, 3, 4, 9, 8, 7]
