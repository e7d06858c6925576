"""Uploaded (and produced) files: a row in the `files` table and its bytes in the blob store, kept together.

`save` writes the blob first and the row after; if the row cannot be written the blob is removed, and a
blob over the size limit is never kept (BlobTooLarge), so a failed upload leaves nothing behind. `delete`
removes the row, then the blob.
"""
from __future__ import annotations

import asyncio
import hashlib
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.store.blobs import CHUNK, BlobStore
from chatloom.store.models import StoredFile, new_id


class _Hashing:
    """A reader that hashes what passes through it (the blob store reads the upload once)."""

    def __init__(self, source: BinaryIO) -> None:
        self.source = source
        self.sha = hashlib.sha256()

    def read(self, size: int = CHUNK) -> bytes:
        piece = self.source.read(size)
        self.sha.update(piece)
        return piece


def blob_key(user_id: str, file_id: str) -> str:
    return f"files/{user_id}/{file_id}"


class StoredFiles:
    def __init__(self, session: AsyncSession, blobs: BlobStore) -> None:
        self.session = session
        self.blobs = blobs

    async def save(self, user_id: str, filename: str, purpose: str, data: BinaryIO | bytes,
                   max_bytes: int | None = None, content_type: str | None = None,
                   status: str = "processed") -> StoredFile:
        """Store the bytes (in a worker thread: it is disk work) and the row, committed; BlobTooLarge past
        `max_bytes`, with nothing kept."""
        file_id = new_id("file")
        key = blob_key(user_id, file_id)
        if isinstance(data, (bytes, bytearray)):
            size = await asyncio.to_thread(self.blobs.put, key, data, max_bytes)
            digest = hashlib.sha256(data).hexdigest()
        else:
            reader = _Hashing(data)
            size = await asyncio.to_thread(self.blobs.put, key, reader, max_bytes)
            digest = reader.sha.hexdigest()
        row = StoredFile(id=file_id, user_id=user_id, filename=filename[:255], purpose=purpose,
                         content_type=content_type, bytes=size, blob_key=key, sha256=digest, status=status)
        try:
            self.session.add(row)
            await self.session.commit()
        except BaseException:
            await self.session.rollback()
            self.blobs.delete(key)
            raise
        return row

    async def get_owned(self, user_id: str, file_id: str) -> StoredFile | None:
        row = await self.session.get(StoredFile, file_id)
        return row if row is not None and row.user_id == user_id else None

    async def page(self, user_id: str, purpose: str | None, after: str | None, limit: int,
                   newest_first: bool = True) -> list[StoredFile]:
        """The user's files in id order (ids sort by creation time), after the file `after`."""
        query = select(StoredFile).where(StoredFile.user_id == user_id)
        if purpose:
            query = query.where(StoredFile.purpose == purpose)
        if after:
            query = query.where(StoredFile.id < after if newest_first else StoredFile.id > after)
        order = StoredFile.id.desc() if newest_first else StoredFile.id.asc()
        return list(await self.session.scalars(query.order_by(order).limit(limit)))

    async def delete(self, row: StoredFile) -> None:
        await self.session.delete(row)
        await self.session.commit()
        self.blobs.delete(row.blob_key)
