"""Files for retrieval through the product API: upload, extraction, search, attachment, citations in
answers, bad files refused with nothing kept, another user's ids 404, and deletion that leaves nothing."""
from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from app_testing import RecordingBackend, app_client, done_of, make_settings, new_conversation, send, signup
from file_samples import PNG, make_docx, make_docx_bomb, make_encrypted_pdf, make_pdf

LLAMAS = ("# Camelids\n\nThe llama is a domesticated South American camelid, used as a pack animal by Andean "
          "cultures since pre-Columbian times.\n\n" + "Filler sentence about nothing in particular. " * 60 +
          "\n\n## Zebras\n\nThe zebra quagga lives on the savanna and is known for its striped coat.\n")


async def upload(client, headers, name: str, data: bytes, **form):
    return await client.post("/files", headers=headers, files={"file": (name, data)}, data=form)


async def counts(app) -> dict[str, int]:
    """Rows of every retrieval table, the full-text index's entries, and blobs on disk."""
    db = app.state.ctx.db
    out = {}
    async with db.engine.connect() as conn:
        for table in ("files", "file_texts", "file_chunks", "collection_files", "conversation_files"):
            out[table] = (await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar()
        out["vectors"] = (await conn.execute(text(
            "SELECT count(*) FROM file_chunks WHERE embedding IS NOT NULL"))).scalar()
        if db.is_sqlite:
            out["fts"] = (await conn.execute(text("SELECT count(*) FROM file_chunks_fts_docsize"))).scalar()
    root = Path(app.state.ctx.settings.server.data_dir) / "blobs"
    out["blobs"] = sum(1 for p in root.rglob("*") if p.is_file()) if root.exists() else 0
    return out


async def test_upload_extract_list_read_and_search(client, alice):
    cid = await new_conversation(client, alice)
    r = await upload(client, alice, "camelids.md", LLAMAS.encode(), conversation_id=cid)
    assert r.status_code == 201, r.text
    f = r.json()
    assert f["status"] == "processed" and f["content_type"] == "text/markdown" and f["bytes"] == len(LLAMAS.encode())
    assert f["status_details"] is None  # passages embedded too
    assert [x["id"] for x in (await client.get("/files", headers=alice)).json()] == [f["id"]]
    assert [x["id"] for x in (await client.get(f"/files?conversation_id={cid}", headers=alice)).json()] == [f["id"]]
    body = (await client.get(f"/files/{f['id']}/text", headers=alice)).json()
    assert body["kind"] == "markdown" and body["text"] == LLAMAS
    passages = (await client.get(f"/files/{f['id']}/passages", headers=alice)).json()
    assert len(passages) >= 3
    for a, b in zip(passages, passages[1:]):
        assert b["char_start"] < a["char_end"]  # overlapping
    assert all(LLAMAS[p["char_start"]:p["char_end"]] == p["text"] for p in passages)
    content = await client.get(f"/files/{f['id']}/content", headers=alice)
    assert content.content == LLAMAS.encode()
    for mode in ("fulltext", "hybrid"):
        found = (await client.get("/files/search", headers=alice, params={"q": "where do zebras live?",
                                                                         "mode": mode})).json()
        assert "savanna" in found[0]["text"], mode
    vector = (await client.get("/files/search", headers=alice, params={"q": "zebra", "mode": "vector"})).json()
    assert len(vector) == min(5, len(passages))


async def test_embeddings_are_off_by_default(tmp_path, tiny_backend):
    async with app_client(make_settings(tmp_path), tiny_backend) as (client, app, alice):
        r = await upload(client, alice, "a.md", LLAMAS.encode())
        assert r.status_code == 201 and "full-text search only" in r.json()["status_details"]
        c = await counts(app)
        assert c["file_chunks"] > 0 and c["vectors"] == 0
        found = (await client.get("/files/search", headers=alice, params={"q": "zebra savanna"})).json()
        assert "savanna" in found[0]["text"]


async def test_pdf_and_docx_text_is_extracted_with_pages(client, alice):
    pdf = await upload(client, alice, "report.bin", make_pdf(["Quarterly revenue grew strongly.",
                                                              "The warehouse in Lyon opened in March."]))
    assert pdf.status_code == 201, pdf.text
    assert pdf.json()["content_type"] == "application/pdf"
    passages = (await client.get(f"/files/{pdf.json()['id']}/passages", headers=alice)).json()
    assert "Lyon" in passages[0]["text"] and passages[0]["page"] == 1
    docx = await upload(client, alice, "memo.pdf", make_docx(["Memo: the badge office moved to floor seven."]))
    assert docx.status_code == 201 and "wordprocessingml" in docx.json()["content_type"]
    found = (await client.get("/files/search", headers=alice, params={"q": "badge office", "mode": "fulltext"})).json()
    assert found[0]["file_id"] == docx.json()["id"]


@pytest.mark.parametrize("name, data, status, code", [
    ("photo.txt", PNG, 415, "unsupported_file_type"),
    ("broken.pdf", b"%PDF-1.7\n1 0 obj << /Type /Catalog", 400, "corrupt_file"),
    ("locked.pdf", None, 400, "encrypted_file"),
    ("bomb.docx", None, 413, "file_too_large"),
    ("empty.txt", b"", 400, "empty_file"),
    ("archive.zip", b"PK\x03\x04" + b"\x00" * 40, 400, "corrupt_file"),
])
async def test_bad_files_are_refused_and_nothing_is_kept(client, app, alice, name, data, status, code):
    data = {"locked.pdf": make_encrypted_pdf, "bomb.docx": make_docx_bomb}.get(name, lambda: data)()
    r = await upload(client, alice, name, data)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert all(n == 0 for n in (await counts(app)).values())


async def test_size_limits_are_413(tmp_path, tiny_backend):
    settings = make_settings(tmp_path, files={"max_file_bytes": 2000, "max_user_bytes": 3000, "embeddings": True})
    async with app_client(settings, tiny_backend) as (client, app, alice):
        assert (await upload(client, alice, "a.txt", b"x " * 1001)).status_code == 413
        assert (await upload(client, alice, "a.txt", b"word " * 300)).status_code == 201
        r = await upload(client, alice, "b.txt", b"word " * 320)
        assert r.status_code == 413 and r.json()["error"]["code"] == "storage_quota_exceeded"
        # Past the upload limit and the multipart framing, the edge refuses before reading it all.
        big = await upload(client, alice, "c.txt", b"y" * 200_000)
        assert big.status_code == 413
        assert (await counts(app))["files"] == 1


async def test_another_users_files_and_collections_are_404(client, alice):
    bob = await signup(client, "bob")
    cid = await new_conversation(client, alice)
    fid = (await upload(client, alice, "a.md", LLAMAS.encode(), conversation_id=cid)).json()["id"]
    coll = (await client.post("/collections", headers=alice, json={"name": "mine"})).json()["id"]
    bob_cid = await new_conversation(client, bob)
    for method, url in [("GET", f"/files/{fid}"), ("GET", f"/files/{fid}/text"), ("GET", f"/files/{fid}/content"),
                        ("GET", f"/files/{fid}/passages"), ("DELETE", f"/files/{fid}"),
                        ("GET", f"/files?conversation_id={cid}"), ("DELETE", f"/collections/{coll}")]:
        assert (await client.request(method, url, headers=bob)).status_code == 404, url
    assert (await upload(client, bob, "x.txt", b"hello", conversation_id=cid)).status_code == 404
    assert (await upload(client, bob, "x.txt", b"hello", collection_id=coll)).status_code == 404
    for body in ({"file_id": fid}, {"collection_id": coll}):
        r = await client.post(f"/conversations/{bob_cid}/files", headers=bob, json=body)
        assert r.status_code == 404, body
    assert (await client.get("/files/search", headers=bob, params={"q": "llama"})).json() == []
    assert (await client.get(f"/files/{fid}", headers=alice)).status_code == 200


async def test_answers_retrieve_passages_and_cite_them(tmp_path, tiny_model_fp32):
    from chatloom.engine import EngineConfig
    from chatloom.serving import LocalBackend

    inner = LocalBackend(tiny_model_fp32, engine_config=EngineConfig(num_blocks=512))
    await inner.start()
    backend = RecordingBackend(inner)
    try:
        # tiny-random tokenizes by character: short passages, a budget for two of them (and no file_search
        # tool, whose description would count against the system prompt measured below)
        settings = make_settings(tmp_path, files={"prompt_tokens": 700, "top_k": 2, "chunk_chars": 300,
                                                  "embeddings": True, "search_tool": False})
        async with app_client(settings, backend) as (client, app, alice):
            cid = await new_conversation(client, alice)
            coll = (await client.post("/collections", headers=alice, json={"name": "zoo"})).json()["id"]
            fid = (await upload(client, alice, "zoo.md", LLAMAS.encode(), collection_id=coll)).json()["id"]
            _, events = await send(client, alice, cid, "Where does the zebra quagga live?")
            assert "Excerpts" not in backend.answers()[-1].messages[0]["content"]  # nothing attached yet
            assert (await client.post(f"/conversations/{cid}/files", headers=alice,
                                      json={"collection_id": coll})).status_code == 204
            _, events = await send(client, alice, cid, "Where does the zebra quagga live?")
            system = backend.answers()[-1].messages[0]["content"]
            assert "[1] zoo.md" in system and "savanna" in system
            done = done_of(events)
            cites = done["citations"]
            assert cites[0]["n"] == 1 and cites[0]["file_id"] == fid and "savanna" in cites[0]["text"]
            assert inner.count_tokens(system) < inner.count_tokens(settings.chat.system_prompt) + 700
            detail = (await client.get(f"/conversations/{cid}", headers=alice)).json()
            answer = [m for m in detail["messages"] if m["id"] == done["message_id"]][0]
            assert answer["citations"] == cites
            whole = (await client.get(f"/files/{fid}/text", headers=alice)).json()["text"]
            assert whole[cites[0]["char_start"]:cites[0]["char_end"]] == cites[0]["text"]
    finally:
        await inner.close()


async def test_deleting_a_file_conversation_or_collection_leaves_nothing(client, app, alice):
    cid = await new_conversation(client, alice)
    other = await new_conversation(client, alice)
    one = (await upload(client, alice, "one.md", LLAMAS.encode(), conversation_id=cid)).json()["id"]
    await upload(client, alice, "two.txt", b"plain words about boats " * 80, conversation_id=cid)
    shared = (await upload(client, alice, "three.txt", b"shared between chats " * 50, conversation_id=other)).json()
    assert (await client.post(f"/conversations/{cid}/files", headers=alice,
                              json={"file_id": shared["id"]})).status_code == 204
    coll = (await client.post("/collections", headers=alice, json={"name": "keep"})).json()["id"]
    kept = (await upload(client, alice, "four.txt", b"collection text " * 40, collection_id=coll)).json()["id"]
    assert (await client.post(f"/conversations/{cid}/files", headers=alice, json={"file_id": kept})).status_code == 204
    before = await counts(app)
    assert before["files"] == 4 and before["blobs"] == 4 and before["vectors"] == before["file_chunks"] > 4

    assert (await client.delete(f"/files/{one}", headers=alice)).status_code == 204
    assert (await client.get(f"/files/{one}", headers=alice)).status_code == 404
    after_file = await counts(app)
    assert after_file["files"] == 3 and after_file["blobs"] == 3 and after_file["file_texts"] == 3

    # The conversation alone held two.txt: it goes; three.txt (another chat) and four.txt (a collection) stay.
    assert (await client.delete(f"/conversations/{cid}", headers=alice)).status_code == 204
    names = sorted(f["filename"] for f in (await client.get("/files", headers=alice)).json())
    assert names == ["four.txt", "three.txt"]
    assert (await counts(app))["blobs"] == 2

    assert (await client.delete(f"/conversations/{other}", headers=alice)).status_code == 204
    assert (await client.delete(f"/collections/{coll}", headers=alice)).status_code == 204
    left = await counts(app)
    assert all(n == 0 for n in left.values()), left


async def test_deleting_an_account_removes_its_files_and_keeps_others(client, app, alice):
    bob = await signup(client, "bob")
    cid = await new_conversation(client, alice)
    await send(client, alice, cid, "hello")
    coll = (await client.post("/collections", headers=alice, json={"name": "c"})).json()["id"]
    await upload(client, alice, "a.md", LLAMAS.encode(), conversation_id=cid)
    await upload(client, alice, "b.txt", b"words in a collection " * 30, collection_id=coll)
    await upload(client, bob, "bob.txt", b"bob keeps this " * 30)
    assert (await client.delete("/auth/me", headers=alice)).status_code == 204
    assert (await client.get("/auth/me", headers=alice)).status_code == 401
    left = await counts(app)
    assert left["files"] == 1 and left["blobs"] == 1 and left["file_texts"] == 1
    async with app.state.ctx.db.engine.connect() as conn:
        for table in ("conversations", "messages", "collections", "collection_files"):
            assert (await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar() == 0, table
        owners = (await conn.execute(text("SELECT DISTINCT user_id FROM file_chunks"))).scalars().all()
    assert len(owners) == 1
    assert [f["filename"] for f in (await client.get("/files", headers=bob)).json()] == ["bob.txt"]
