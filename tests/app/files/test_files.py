"""Files for retrieval through the product API: upload, extraction, search, attachment, citations in
answers, bad files refused with nothing kept, another user's ids 404, and deletion that leaves nothing."""
from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from chatloom.store.models import Base

from app_testing import RecordingBackend, app_client, done_of, make_settings, new_conversation, send, signup
from file_samples import (ELF, PNG, make_docx, make_docx_bomb, make_encrypted_pdf, make_pdf, make_pdf_bomb,
                          understate_sizes)

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


async def every_row(app) -> dict[str, int]:
    """Rows of every table the models declare, the search indexes' own entries (SQLite's FTS5 tables;
    PostgreSQL's are GIN indexes over those rows), and blobs on disk: what a deletion may leave behind."""
    db = app.state.ctx.db
    async with db.engine.connect() as conn:
        out = {t.name: (await conn.execute(select(func.count()).select_from(t))).scalar()
               for t in Base.metadata.sorted_tables}
        if db.is_sqlite:
            for index in ("chat_fts", "file_chunks_fts_docsize"):
                out[index] = (await conn.execute(text(f"SELECT count(*) FROM {index}"))).scalar()
    out["vectors"] = (await counts(app))["vectors"]
    out["blobs"] = (await counts(app))["blobs"]
    return out


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, tuple[int, int]]:
    return {k: (before.get(k, 0), n) for k, n in after.items() if n != before.get(k, 0)}


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
    # Restricted by an owner password only (no password to open it, as many published PDFs are): read.
    for algorithm in ("RC4-128", "AES-256"):
        restricted = await upload(client, alice, "statement.pdf", make_encrypted_pdf(
            "", (f"Otters hold hands while sleeping ({algorithm}).",), algorithm))
        assert restricted.status_code == 201, restricted.text
        text_of = (await client.get(f"/files/{restricted.json()['id']}/text", headers=alice)).json()["text"]
        assert f"Otters hold hands while sleeping ({algorithm})." in text_of
    docx = await upload(client, alice, "memo.pdf", make_docx(["Memo: the badge office moved to floor seven."]))
    assert docx.status_code == 201 and "wordprocessingml" in docx.json()["content_type"]
    found = (await client.get("/files/search", headers=alice, params={"q": "badge office", "mode": "fulltext"})).json()
    assert found[0]["file_id"] == docx.json()["id"]


@pytest.mark.parametrize("name, data, status, code", [
    ("photo.txt", PNG, 415, "unsupported_file_type"),
    ("notes.txt", ELF, 415, "unsupported_file_type"),  # a program named as text: the content decides
    ("broken.pdf", b"%PDF-1.7\n1 0 obj << /Type /Catalog", 400, "corrupt_file"),
    ("locked.pdf", None, 400, "encrypted_file"),
    ("bomb.docx", None, 413, "file_too_large"),
    ("bomb.pdf", None, 413, "file_too_large"),  # 4 MB of drawing operators from 12 KB: minutes to parse
    ("form-bomb.pdf", None, 413, "file_too_large"),  # the same, in a form the page draws
    ("liar.docx", None, 400, "corrupt_file"),  # the bomb, its sizes understated: read only as far as it claims
    ("empty.txt", b"", 400, "empty_file"),
    ("archive.zip", b"PK\x03\x04" + b"\x00" * 40, 400, "corrupt_file"),
])
async def test_bad_files_are_refused_and_nothing_is_kept(client, app, alice, name, data, status, code):
    data = {"locked.pdf": make_encrypted_pdf, "bomb.docx": make_docx_bomb, "bomb.pdf": make_pdf_bomb,
            "form-bomb.pdf": lambda: make_pdf_bomb(in_form=True),
            "liar.docx": lambda: understate_sizes(make_docx_bomb(), 5_000)}.get(name, lambda: data)()
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


async def test_a_tiers_own_limits_are_413_and_other_tiers_keep_theirs(tmp_path, tiny_backend):
    tiers = tmp_path / "tiers.toml"
    tiers.write_text("[free]\nmax_file_bytes = 1500\nmax_storage_bytes = 2500\n")
    settings = make_settings(tmp_path, traffic={"tiers_file": str(tiers)},
                             files={"max_file_bytes": 4000, "max_user_bytes": 6000})
    async with app_client(settings, tiny_backend) as (client, app, alice):
        bob = await signup(client, "bob")
        bob_id = (await client.get("/auth/me", headers=bob)).json()["id"]
        async with app.state.ctx.db.engine.begin() as conn:
            await conn.execute(text("UPDATE users SET tier = 'pro' WHERE id = :id"), {"id": bob_id})
        app.state.ctx.callers.forget_user(bob_id)
        r = await upload(client, alice, "a.txt", b"word " * 320)  # 1,600 bytes: over the free tier's 1,500
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large", r.text
        assert "limit of 1500 bytes" in r.json()["error"]["message"]
        assert (await upload(client, alice, "a.txt", b"word " * 280)).status_code == 201
        r = await upload(client, alice, "b.txt", b"word " * 280)  # 2,800 kept: over the free tier's 2,500
        assert r.status_code == 413 and r.json()["error"]["code"] == "storage_quota_exceeded", r.text
        assert "storage limit is 2500" in r.json()["error"]["message"]
        # The pro tier sets no limits of its own: the [files] settings hold.
        assert (await upload(client, bob, "a.txt", b"word " * 320)).status_code == 201
        r = await upload(client, bob, "b.txt", b"word " * 900)  # 4,500 bytes: over [files] max_file_bytes
        assert r.status_code == 413 and "limit of 4000 bytes" in r.json()["error"]["message"], r.text
        left = await counts(app)
        assert left["files"] == left["blobs"] == left["file_texts"] == 2
        listed = {t["name"]: t for t in (await client.get("/admin/tiers", headers=alice)).json()["tiers"]}
        assert (listed["free"]["max_file_bytes"], listed["free"]["max_storage_bytes"]) == (1500, 2500)
        assert listed["pro"]["max_file_bytes"] is None


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
    assert (await client.post(f"/conversations/{cid}/files", headers=alice,
                              json={"collection_id": coll})).status_code == 204
    bob_fid = (await upload(client, bob, "b.txt", b"bob's own words", conversation_id=bob_cid)).json()["id"]
    bob_coll = (await client.post("/collections", headers=bob, json={"name": "his"})).json()["id"]
    for method, url, body in [
            ("GET", f"/files?collection_id={coll}", None),
            ("GET", f"/conversations/{cid}/files", None),
            ("GET", f"/files/search?q=llama&conversation_id={cid}", None),
            ("POST", f"/collections/{coll}/files", {"file_id": bob_fid}),  # his file, her collection
            ("POST", f"/collections/{bob_coll}/files", {"file_id": fid}),  # her file, his collection
            ("DELETE", f"/conversations/{cid}/files/{fid}", None),  # her conversation
            ("DELETE", f"/conversations/{cid}/collections/{coll}", None),
            ("DELETE", f"/conversations/{bob_cid}/files/{fid}", None),  # his conversation, her ids
            ("DELETE", f"/conversations/{bob_cid}/collections/{coll}", None)]:
        r = await client.request(method, url, headers=bob, json=body)
        assert r.status_code == 404, (method, url, r.status_code)
        assert r.json()["error"]["code"].endswith("_not_found"), r.text
    found = (await client.get("/files/search", headers=bob, params={"q": "llama"})).json()
    assert {p["file_id"] for p in found} <= {bob_fid}
    assert (await client.get(f"/files/{fid}", headers=alice)).status_code == 200
    # Nothing of hers moved: still attached, still in her collection.
    attached = (await client.get(f"/conversations/{cid}/files", headers=alice)).json()
    assert [f["id"] for f in attached["files"]] == [fid] and [c["id"] for c in attached["collections"]] == [coll]
    assert (await client.get(f"/files?collection_id={bob_coll}", headers=bob)).json() == []
    # The owner detaches for real; a second detach finds nothing attached.
    assert (await client.delete(f"/conversations/{cid}/files/{fid}", headers=alice)).status_code == 204
    assert (await client.delete(f"/conversations/{cid}/files/{fid}", headers=alice)).status_code == 404
    assert (await client.delete(f"/conversations/{cid}/collections/{coll}", headers=alice)).status_code == 204


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
    start = await every_row(app)
    cid = await new_conversation(client, alice)
    await send(client, alice, cid, "a question about boats")  # messages, their search index entries
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
    # Every table and index is back where it started, but for the account's own metering of its tokens.
    assert grown(start, await every_row(app)).keys() <= {"usage"}, grown(start, await every_row(app))


async def test_deleting_an_account_removes_its_files_and_keeps_others(client, app, alice):
    bob = await signup(client, "bob")
    await upload(client, bob, "bob.txt", b"bob keeps this " * 30)
    bob_cid = await new_conversation(client, bob)
    await send(client, bob, bob_cid, "bob's question")
    start = await every_row(app)  # alice has an account and nothing else yet

    cid = await new_conversation(client, alice)
    _, events = await send(client, alice, cid, "hello")
    answer = done_of(events)["message_id"]
    coll = (await client.post("/collections", headers=alice, json={"name": "c"})).json()["id"]
    await upload(client, alice, "a.md", LLAMAS.encode(), conversation_id=cid)
    await upload(client, alice, "b.txt", b"words in a collection " * 30, collection_id=coll)
    assert (await client.post(f"/conversations/{cid}/files", headers=alice,
                              json={"collection_id": coll})).status_code == 204
    for method, url, body in [("POST", f"/conversations/{cid}/shares", None),
                              ("POST", "/memories", {"text": "I keep bees."}),
                              ("PUT", "/me/instructions", {"text": "Be terse."}),
                              ("POST", "/auth/api-keys", {"name": "laptop"}),
                              ("POST", f"/messages/{answer}/feedback", {"rating": "up"})]:
        r = await client.request(method, url, headers=alice, json=body)
        assert r.status_code in (200, 201), (url, r.text)
    made = grown(start, await every_row(app))
    for table in ("conversations", "messages", "files", "file_chunks", "collections", "conversation_collections",
                  "shared_links", "memories", "custom_instructions", "api_keys", "feedback", "usage", "blobs"):
        assert table in made, table  # each kind of thing an account holds was made, so its removal counts

    assert (await client.delete("/auth/me", headers=alice)).status_code == 204
    assert (await client.get("/auth/me", headers=alice)).status_code == 401
    left = await counts(app)
    assert left["files"] == 1 and left["blobs"] == 1 and left["file_texts"] == 1
    async with app.state.ctx.db.engine.connect() as conn:
        for table in ("collections", "collection_files"):
            assert (await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar() == 0, table
        owners = (await conn.execute(text("SELECT DISTINCT user_id FROM file_chunks"))).scalars().all()
    assert len(owners) == 1
    assert [f["filename"] for f in (await client.get("/files", headers=bob)).json()] == ["bob.txt"]
    # Every table and index holds what it held before alice did anything, less her account. The audit log
    # is the exception by design: it keeps what the account did, its deletion included (docs/security.md).
    after = await every_row(app)
    assert after.pop("audit_events") > start.pop("audit_events")
    assert grown(start, after) == {"users": (start["users"], start["users"] - 1)}
