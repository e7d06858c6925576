"""Where uploaded files' bytes live: a blob store.

Rows in the `files` table (store/models.py, `StoredFile`) say what a file is and whose; the bytes live
in a `BlobStore` under the row's `blob_key`. `LocalBlobStore` keeps them on the local disk under the
data folder, which serves one gateway; several gateways need a store they all reach (a shared folder,
an object store), which implements the same four methods.
"""
from __future__ import annotations

import abc
import errno
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO, Iterator

_KEY = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}(/[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}){0,3}$")
CHUNK = 1 << 20


class BlobTooLarge(ValueError):
    """The blob passed the size limit given to put(); nothing was kept."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"file is larger than the limit of {limit} bytes")
        self.limit = limit


class StorageFull(OSError):
    """The blob store's disk (or quota) is full; nothing was kept. Space may come back: retry later."""


class BlobNotFound(KeyError):
    """No blob under that key (never written, or deleted)."""


def check_key(key: str) -> str:
    """Keys are relative paths of up to four plain segments: no '..', no absolute paths."""
    if not _KEY.match(key) or ".." in key.split("/"):
        raise ValueError(f"bad blob key {key!r}")
    return key


class BlobStore(abc.ABC):
    """Bytes by key. Writes are all or nothing: a reader never sees half a blob."""

    @abc.abstractmethod
    def put(self, key: str, data: BinaryIO | bytes, max_bytes: int | None = None) -> int:
        """Store `data` under `key` (replacing any blob there) and return its size. Raises
        BlobTooLarge, keeping nothing, when it is longer than `max_bytes`, and StorageFull, keeping
        nothing, when the store has no room left."""

    @abc.abstractmethod
    def open(self, key: str) -> BinaryIO:
        """The blob for reading; raises BlobNotFound."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove the blob for good; False when there was none."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a blob is stored under `key`."""

    def read(self, key: str) -> bytes:
        with self.open(key) as f:
            return f.read()

    def iter_chunks(self, key: str, size: int = CHUNK) -> Iterator[bytes]:
        """The blob in pieces, for streaming it out without holding it in memory."""
        with self.open(key) as f:
            while piece := f.read(size):
                yield piece


class LocalBlobStore(BlobStore):
    """Blobs as files under one folder (default: `<data_dir>/blobs`)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: BinaryIO | bytes, max_bytes: int | None = None) -> int:
        path = self._path(key)
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
        size = 0
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(partial, "wb") as out:
                if isinstance(data, (bytes, bytearray, memoryview)):
                    size = len(data)
                    if max_bytes is not None and size > max_bytes:
                        raise BlobTooLarge(max_bytes)
                    out.write(data)
                else:
                    while piece := data.read(CHUNK):
                        size += len(piece)
                        if max_bytes is not None and size > max_bytes:
                            raise BlobTooLarge(max_bytes)
                        out.write(piece)
                out.flush()
                os.fsync(out.fileno())
            os.replace(partial, path)  # all or nothing: readers see the old blob or the whole new one
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFull(exc.errno, f"no space left for blobs under {self.root}") from None
            raise
        finally:
            partial.unlink(missing_ok=True)
        return size

    def open(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError:
            raise BlobNotFound(key) from None

    def delete(self, key: str) -> bool:
        try:
            self._path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete_prefix(self, prefix: str) -> int:
        """Remove every blob under a folder-like prefix (a user's, when the account is deleted)."""
        folder = self._path(prefix)
        if not folder.is_dir():
            return 0
        count = sum(1 for p in folder.rglob("*") if p.is_file())
        shutil.rmtree(folder)
        return count
