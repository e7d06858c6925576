"""Passages and questions embedded by a remote OpenAI-compatible embedding server (files.embeddings_url)
instead of the served model, and full-text search when that server fails, never a failed answer."""
from __future__ import annotations

import logging

import pytest
from sqlalchemy import select

from chatloom.store.file_chunks import FileChunk

from app_testing import app_client, done_of, make_settings, new_conversation, send
from fake_embeddings import WIDTH, fake_embeddings

DOC = ("Alpine marmots whistle loudly when an eagle circles above the meadow.\n\n" + "Padding words. " * 30 +
       "\n\nDesert tortoises dig burrows to escape the midday heat of the Mojave.\n\n" + "Padding words. " * 30 +
       "\n\nHarbour seals haul out on sandbanks between tides to rest and warm up.\n")


@pytest.fixture
def fake():
    with fake_embeddings() as server:
        yield server


def remote_settings(tmp_path, db_url, url: str):
    return make_settings(tmp_path, server={"db_url": db_url},
                         files={"embeddings": True, "embeddings_url": url, "embedding_model": "fake-embed",
                                "embeddings_api_key": "sk-remote", "chunk_chars": 300, "chunk_overlap_chars": 0})


async def test_the_remote_server_embeds_passages_and_questions(tmp_path, db_url, tiny_backend, fake):
    async with app_client(remote_settings(tmp_path, db_url, fake.url), tiny_backend) as (client, app, alice):
        r = await client.post("/files", headers=alice, files={"file": ("animals.md", DOC.encode())})
        assert r.status_code == 201 and r.json()["status_details"] is None, r.text
        async with app.state.ctx.db.session() as session:
            chunks = (await session.scalars(select(FileChunk))).all()
        # The remote model's vectors (64 wide, not the tiny model's), every passage's, under its name.
        assert chunks and {c.embedding_model for c in chunks} == {"fake-embed"}
        assert {len(c.embedding) for c in chunks} == {4 * WIDTH}
        assert set(fake.auth) == {"Bearer sk-remote"} and {q["model"] for q in fake.requests} == {"fake-embed"}
        found = (await client.get("/files/search", headers=alice,
                                  params={"q": "tortoises burrows Mojave heat", "mode": "vector"})).json()
        assert "tortoises" in found[0]["text"], found
        assert fake.inputs()[-1] == "tortoises burrows Mojave heat"


@pytest.mark.parametrize("mode", ["error", "garbage", "short"])
async def test_a_failing_server_falls_back_to_full_text(tmp_path, db_url, tiny_backend, fake, mode, caplog):
    fake.mode = mode
    settings = remote_settings(tmp_path, db_url, fake.url)
    async with app_client(settings, tiny_backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        with caplog.at_level(logging.WARNING, logger="chatloom.app.files"):
            r = await client.post("/files", headers=alice, files={"file": ("animals.md", DOC.encode())},
                                  data={"conversation_id": cid})
            assert r.status_code == 201, r.text
            details = r.json()["status_details"]
            assert "not embedded" in details and "full-text search only" in details
            found = (await client.get("/files/search", headers=alice,
                                      params={"q": "harbour seals sandbanks", "mode": "hybrid"})).json()
            assert found and "seals" in found[0]["text"]
            # A message in the conversation still gets its answer, with the full-text passages cited.
            _, events = await send(client, alice, cid, "Where do harbour seals rest?")
            done = done_of(events)
            assert done["citations"] and "seals" in done["citations"][0]["text"]
        logged = [rec.getMessage() for rec in caplog.records]
        assert any("not embedded" in m for m in logged) and any("retrieval without vectors" in m for m in logged)
        assert fake.requests  # the server was asked, and its failure did not fail anything


async def test_an_unreachable_server_falls_back_too(tmp_path, db_url, tiny_backend, fake):
    url = fake.url
    fake.httpd.shutdown()
    fake.httpd.server_close()
    async with app_client(remote_settings(tmp_path, db_url, url), tiny_backend) as (client, app, alice):
        r = await client.post("/files", headers=alice, files={"file": ("animals.md", DOC.encode())})
        assert r.status_code == 201 and "not embedded" in r.json()["status_details"], r.text
        found = (await client.get("/files/search", headers=alice, params={"q": "alpine marmots"})).json()
        assert found and "marmots" in found[0]["text"]


def test_a_remote_server_needs_its_model_name(tmp_path):
    with pytest.raises(ValueError, match="embedding_model"):
        make_settings(tmp_path, files={"embeddings_url": "http://127.0.0.1:9/v1/embeddings"})
