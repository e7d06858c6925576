"""File retrieval with the default embedder, the static embedding model run in the gateway: passages stored
under its name at its width, a paraphrase with no word in common found by vectors where full-text search
finds nothing, vectors of another model left out rather than compared, and full-text search alone when
the model's package is missing."""
from __future__ import annotations

import importlib.util
import logging

import httpx
import pytest
from sqlalchemy import select

from chatloom.app.files import builtin_embeddings
from chatloom.app.main import create_app
from chatloom.models.config import ModelError
from chatloom.settings.tree import DEFAULT_EMBEDDING_MODEL
from chatloom.store.file_chunks import FileChunk

from app_testing import app_client, make_settings

needs_wordllama = pytest.mark.skipif(importlib.util.find_spec("wordllama") is None,
                                     reason="needs the wordllama package: pip install --no-deps wordllama==0.4.0.post1")

# One passage per file; none shares a content word with the questions below.
DOCS = {
    "password.md": "To reset a forgotten password, open the sign-in page and ask for a reset link; it arrives by "
                   "email within a minute and works once.",
    "bread.md": "Knead the dough for ten minutes, let it rise in a warm place until doubled, then bake at 220 "
                "degrees until the crust is golden.",
    "bike.md": "A bicycle chain that skips under load is usually worn: measure its stretch with a gauge and "
               "replace it together with the cassette.",
    "weather.md": "Tomorrow brings heavy rain along the coast, with strong winds in the afternoon and cooler "
                  "temperatures overnight.",
    "tax.md": "Quarterly tax payments are due in April, June, September and January; late payments accrue "
              "interest and a penalty.",
}


def builtin_settings(tmp_path, db_url=None, **files):
    return make_settings(tmp_path, server={"db_url": db_url}, files={"embeddings": True, **files})


async def upload_all(client, headers) -> dict[str, dict]:
    out = {}
    for name, body in DOCS.items():
        r = await client.post("/files", headers=headers, files={"file": (name, body.encode())})
        assert r.status_code == 201, r.text
        out[name] = r.json()
    return out


async def search(client, headers, q: str, mode: str) -> list[str]:
    r = await client.get("/files/search", headers=headers, params={"q": q, "mode": mode})
    assert r.status_code == 200, r.text
    return [p["text"] for p in r.json()]


@needs_wordllama
async def test_vectors_find_a_paraphrase_that_full_text_misses(tmp_path, db_url, tiny_backend):
    async with app_client(builtin_settings(tmp_path, db_url), tiny_backend) as (client, app, alice):
        files = await upload_all(client, alice)
        assert all(f["status_details"] is None for f in files.values())
        async with app.state.ctx.db.session() as session:
            chunks = (await session.scalars(select(FileChunk))).all()
        assert len(chunks) == len(DOCS) and {c.embedding_model for c in chunks} == {DEFAULT_EMBEDDING_MODEL}
        assert {len(c.embedding) for c in chunks} == {4 * 256}
        for q, doc in (("What should I do when I cannot remember my passcode?", "password.md"),
                       ("Will it storm by the sea?", "weather.md")):
            assert DOCS[doc] not in await search(client, alice, q, "fulltext")
            for mode in ("vector", "hybrid"):
                assert (await search(client, alice, q, mode))[0] == DOCS[doc], (q, mode)


@needs_wordllama
async def test_vectors_of_another_model_are_left_out_not_compared(tmp_path, tiny_backend):
    # Indexed first by the served tiny model (64 wide), then the gateway restarts with the default embedder.
    served = builtin_settings(tmp_path, embedding_model="tiny-random")
    async with app_client(served, tiny_backend) as (client, app, alice):
        old = (await client.post("/files", headers=alice, files={"file": ("bread.md", DOCS["bread.md"].encode())}))
        assert old.status_code == 201 and old.json()["status_details"] is None
    app = create_app(builtin_settings(tmp_path), tiny_backend)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                                   base_url="http://test") as client:
        login = await client.post("/auth/login", json={"username": "alice", "password": "correct horse"})
        alice = {"Authorization": f"Bearer {login.json()['token']}"}
        r = await client.post("/files", headers=alice, files={"file": ("tax.md", DOCS["tax.md"].encode())})
        assert r.status_code == 201
        async with app.state.ctx.db.session() as session:
            widths = {c.embedding_model: len(c.embedding) for c in (await session.scalars(select(FileChunk))).all()}
        assert widths == {"tiny-random": 4 * 64, DEFAULT_EMBEDDING_MODEL: 4 * 256}
        # The old file's passage has no vector of this model: vector search skips it, full-text still finds it.
        assert await search(client, alice, "knead dough", "vector") == [DOCS["tax.md"]]
        assert (await search(client, alice, "knead dough", "hybrid"))[0] == DOCS["bread.md"]


async def test_a_missing_package_leaves_full_text_search(tmp_path, tiny_backend, monkeypatch, caplog):
    def missing(model_id: str):
        raise ModelError(f"the embedding model {model_id} ships in the wordllama package, which is not installed")

    monkeypatch.setattr(builtin_embeddings, "load_static_embedder", missing)
    with caplog.at_level(logging.WARNING, logger="chatloom.app.files"):
        async with app_client(builtin_settings(tmp_path), tiny_backend) as (client, app, alice):
            r = await client.post("/files", headers=alice, files={"file": ("tax.md", DOCS["tax.md"].encode())})
            assert r.status_code == 201, r.text
            assert "wordllama" in r.json()["status_details"] and "full-text search only" in r.json()["status_details"]
            assert (await search(client, alice, "quarterly tax", "hybrid")) == [DOCS["tax.md"]]
    assert "wordllama package" in caplog.text


def test_the_fusion_weight_defaults_by_embedder():
    from chatloom.settings.tree import STATIC_VECTOR_WEIGHT, FilesSettings

    assert FilesSettings().fusion_weight() == STATIC_VECTOR_WEIGHT
    assert FilesSettings(embedding_model="tiny-random").fusion_weight() == 1.0
    assert FilesSettings(embeddings_url="http://e/v1/embeddings", embedding_model="bge").fusion_weight() == 1.0
    assert FilesSettings(vector_weight=0.5).fusion_weight() == 0.5
    with pytest.raises(ValueError, match="embedding_model"):  # a remote server names its own model
        FilesSettings(embeddings_url="http://e/v1/embeddings")


@needs_wordllama
async def test_an_input_with_no_word_is_refused_not_stored_as_a_zero_vector():
    embedder = builtin_embeddings.BuiltinEmbedder(DEFAULT_EMBEDDING_MODEL)
    model, result = await embedder.embed(None, ["zebra", "savanna"])
    assert model == DEFAULT_EMBEDDING_MODEL and len(result.vectors) == 2 and result.prompt_tokens > 0
    with pytest.raises(builtin_embeddings.BuiltinEmbeddingError, match="without a word"):
        await embedder.embed(None, ["?!"])
