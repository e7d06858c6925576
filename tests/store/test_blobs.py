import io

import pytest

from chatloom.store.blobs import BlobNotFound, BlobTooLarge, LocalBlobStore, check_key


def test_put_read_delete_round_trip(tmp_path):
    store = LocalBlobStore(tmp_path / "blobs")
    assert store.put("usr_1/file_a", b"hello") == 5
    assert store.exists("usr_1/file_a")
    assert store.read("usr_1/file_a") == b"hello"
    assert b"".join(store.iter_chunks("usr_1/file_a", size=2)) == b"hello"
    assert store.delete("usr_1/file_a") is True
    assert store.delete("usr_1/file_a") is False
    with pytest.raises(BlobNotFound):
        store.open("usr_1/file_a")


def test_a_blob_over_the_limit_leaves_nothing_behind(tmp_path):
    store = LocalBlobStore(tmp_path)
    store.put("u/f", b"old")
    with pytest.raises(BlobTooLarge):
        store.put("u/f", io.BytesIO(b"x" * (3 << 20)), max_bytes=2 << 20)
    assert store.read("u/f") == b"old"  # the old blob is untouched, no partial file is left
    assert sorted(p.name for p in (tmp_path / "u").iterdir()) == ["f"]


@pytest.mark.parametrize("key", ["../etc/passwd", "/abs", "a/../b", "", "a//b", "a/b/c/d/e"])
def test_keys_cannot_leave_the_folder(key):
    with pytest.raises(ValueError):
        check_key(key)


def test_delete_prefix_removes_a_users_blobs(tmp_path):
    store = LocalBlobStore(tmp_path)
    store.put("usr_1/a", b"1")
    store.put("usr_1/b", b"2")
    store.put("usr_2/a", b"3")
    assert store.delete_prefix("usr_1") == 2
    assert not store.exists("usr_1/a") and store.exists("usr_2/a")
