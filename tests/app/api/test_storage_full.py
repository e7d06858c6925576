"""A full disk under the data folder: an upload is a 503 with Retry-After naming the cause (the disk
comes back), and nothing of it is kept: no blob, no partial file, no row."""
from __future__ import annotations

import errno
import os

import pytest

from chatloom.store import blobs as blob_module


@pytest.fixture
def full_disk(monkeypatch):
    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(blob_module.os, "fsync", no_space)


async def test_an_upload_onto_a_full_disk_is_a_503_and_keeps_nothing(client, alice, app, full_disk):
    r = await client.post("/v1/files", headers=alice, files={"file": ("a.txt", b"hello " * 100)},
                          data={"purpose": "user_data"})
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "30"
    assert r.json()["error"]["code"] == "storage_full"
    listed = await client.get("/v1/files", headers=alice)
    assert listed.json()["data"] == []
    root = app.state.ctx.blobs.root
    assert not root.exists() or [p for p in root.rglob("*") if p.is_file()] == []


def test_the_blob_store_says_storage_full_and_leaves_no_partial_file(tmp_path, full_disk):
    store = blob_module.LocalBlobStore(tmp_path)
    with pytest.raises(blob_module.StorageFull):
        store.put("u/f", b"data")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
