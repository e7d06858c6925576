"""A user's files: upload (store, extract, chunk, index), list, attach, and delete for real.

An upload is all or nothing: the bytes go to the blob store and the rows (the file, its text, its
passages and their vectors, its attachment) are committed together once everything is ready; if
anything fails, the blob is removed again and no row stays. The passages' vectors are embedded through
the pipeline's embed path (the user's quota and the admission queue, as any model work), or by the
remote embedding server of `files.embeddings_url`: when that is refused or fails, the file is kept with
full-text search only, and its `status_details` says why.

Deleting removes the rows and the blob together: a file; the files a deleted conversation alone held;
the files a deleted collection alone held; all of a deleted account's files.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging

from sqlalchemy import delete, exists, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.core.errors import ApiError, not_found
from chatloom.app.files.chunking import chunk_spans
from chatloom.app.files.extract import CONTENT_TYPES, Extracted, Limits, extract
from chatloom.app.files.search import pack
from chatloom.app.files.remote_embeddings import RemoteEmbedder
from chatloom.app.generation.embedding import Embedder
from chatloom.app.traffic.tiers import TierTable
from chatloom.serving import BackendError, BadGenerationRequest
from chatloom.settings import Settings
from chatloom.store import Conversation, Database, User
from chatloom.store.blobs import BlobStore
from chatloom.store.file_chunks import (Collection, CollectionFile, ConversationCollection, ConversationFile,
                                        FileChunk, FileText)
from chatloom.store.models import StoredFile, new_id
from chatloom.store.vector_index import PGVECTOR, write_pg_vectors

log = logging.getLogger(__name__)
PURPOSE = "user_data"
EMBED_BATCH = 32  # passages per embeddings request while indexing


class Files:
    def __init__(self, db: Database, blobs: BlobStore, embedder: Embedder | RemoteEmbedder, settings: Settings,
                 tiers: TierTable | None = None) -> None:
        self.db = db
        self.blobs = blobs
        self.embedder = embedder
        self.settings = settings
        self.tiers = tiers

    def max_file_bytes(self, user: User) -> int:
        """The largest upload this user may make: [files] max_file_bytes, lowered by their tier's own."""
        tier = self.tiers.for_user(user.tier).max_file_bytes if self.tiers else None
        limit = self.settings.files.max_file_bytes
        return limit if tier is None else min(limit, tier)

    def max_storage_bytes(self, user: User) -> int:
        """The most bytes of files this user may keep: [files] max_user_bytes, lowered by their tier's own."""
        tier = self.tiers.for_user(user.tier).max_storage_bytes if self.tiers else None
        limit = self.settings.files.max_user_bytes
        return limit if tier is None else min(limit, tier)

    @property
    def limits(self) -> Limits:
        f = self.settings.files
        return Limits(f.max_extracted_chars, f.max_archive_ratio)

    # -- reading ---------------------------------------------------------------------------
    async def get(self, session: AsyncSession, user_id: str, file_id: str) -> StoredFile:
        """The user's own retrieval file; 404 for anyone else's (the same answer as for no file)."""
        row = await session.get(StoredFile, file_id)
        if row is None or row.user_id != user_id or row.purpose != PURPOSE:
            raise not_found("file")
        return row

    async def list(self, session: AsyncSession, user_id: str, conversation_id: str | None = None,
                   collection_id: str | None = None) -> list[StoredFile]:
        q = select(StoredFile).where(StoredFile.user_id == user_id, StoredFile.purpose == PURPOSE)
        if conversation_id is not None:
            q = q.join(ConversationFile, ConversationFile.file_id == StoredFile.id).where(
                ConversationFile.conversation_id == conversation_id)
        if collection_id is not None:
            q = q.join(CollectionFile, CollectionFile.file_id == StoredFile.id).where(
                CollectionFile.collection_id == collection_id)
        return list((await session.scalars(q.order_by(StoredFile.created.desc()))).all())

    async def text(self, session: AsyncSession, user_id: str, file_id: str) -> tuple[StoredFile, FileText]:
        row = await self.get(session, user_id, file_id)
        body = await session.get(FileText, file_id)
        if body is None:
            raise not_found("file")
        return row, body

    async def chunks(self, session: AsyncSession, user_id: str, file_id: str) -> list[FileChunk]:
        await self.get(session, user_id, file_id)
        return list((await session.scalars(select(FileChunk).where(FileChunk.file_id == file_id)
                                           .order_by(FileChunk.ordinal))).all())

    # -- upload ----------------------------------------------------------------------------
    async def upload(self, user: User, filename: str, data: bytes, conversation: Conversation | None = None,
                     collection: Collection | None = None) -> StoredFile:
        """Store, extract, chunk and index one file, attached where given; ApiError 4xx on bad input."""
        limit = self.max_file_bytes(user)
        if len(data) > limit:
            raise ApiError(413, f"the file is larger than the limit of {limit} bytes", "file_too_large", "file")
        async with self.db.session() as session:
            used = await session.scalar(select(func.coalesce(func.sum(StoredFile.bytes), 0)).where(
                StoredFile.user_id == user.id))
        quota = self.max_storage_bytes(user)
        if used + len(data) > quota:
            raise ApiError(413, f"your files would take {used + len(data)} bytes; the storage limit is "
                           f"{quota}", "storage_quota_exceeded", "file")
        extracted = await asyncio.to_thread(extract, data, filename, self.limits)
        spans = chunk_spans(extracted.text, self.settings.files.chunk_chars, self.settings.files.chunk_overlap_chars)
        vectors, model, details = await self._embed(user, [extracted.text[a:b] for a, b in spans])
        file_id = new_id("file")
        key = f"{user.id}/{file_id}"
        await asyncio.to_thread(self.blobs.put, key, data)
        try:
            async with self.db.session() as session:
                row = StoredFile(id=file_id, user_id=user.id, filename=_clean_name(filename), purpose=PURPOSE,
                                 content_type=CONTENT_TYPES[extracted.kind], bytes=len(data), blob_key=key,
                                 sha256=hashlib.sha256(data).hexdigest(), status="processed", status_details=details)
                session.add(row)
                await session.flush()  # the file row before the rows that refer to it (PostgreSQL checks at once)
                session.add(FileText(file_id=file_id, kind=extracted.kind, text=extracted.text))
                chunks = self._chunks(user.id, file_id, extracted, spans, vectors, model)
                session.add_all(chunks)
                if vectors and self.db.vector_search == PGVECTOR:
                    await session.flush()  # their ids
                    await write_pg_vectors(session, [(c.id, c.embedding) for c in chunks])
                if conversation is not None:
                    session.add(ConversationFile(conversation_id=conversation.id, file_id=file_id))
                if collection is not None:
                    session.add(CollectionFile(collection_id=collection.id, file_id=file_id))
                await session.commit()
        except BaseException:
            await asyncio.to_thread(self.blobs.delete, key)
            raise
        return row

    @staticmethod
    def _chunks(user_id: str, file_id: str, extracted: Extracted, spans: list[tuple[int, int]],
                vectors: list[list[float]] | None, model: str | None) -> list[FileChunk]:
        return [FileChunk(file_id=file_id, user_id=user_id, ordinal=i, text=extracted.text[a:b], char_start=a,
                          char_end=b, page=extracted.page_at(a),
                          embedding=pack(vectors[i]) if vectors else None, embedding_model=model if vectors else None)
                for i, (a, b) in enumerate(spans)]

    async def _embed(self, user: User, texts: list[str]) -> tuple[list[list[float]] | None, str | None, str | None]:
        """Every passage's vector, or none of them (with the reason) when embedding is off or refused."""
        if not self.settings.files.embeddings or not texts:
            return None, None, None if self.settings.files.embeddings else "embeddings are off: full-text search only"
        vectors: list[list[float]] = []
        model = None
        try:
            for i in range(0, len(texts), EMBED_BATCH):
                model, result = await self.embedder.embed(user, texts[i:i + EMBED_BATCH],
                                                          self.settings.files.embedding_model)
                vectors += result.vectors
        except (ApiError, BadGenerationRequest, BackendError) as exc:
            log.warning("file passages not embedded, full-text search only: %s", exc)
            return None, None, f"not embedded ({exc}): full-text search only"
        return vectors, model, None

    # -- collections and attachments ----------------------------------------------------------
    async def collection(self, session: AsyncSession, user_id: str, collection_id: str) -> Collection:
        row = await session.get(Collection, collection_id)
        if row is None or row.user_id != user_id:
            raise not_found("collection")
        return row

    async def create_collection(self, session: AsyncSession, user_id: str, name: str) -> Collection:
        taken = await session.scalar(select(Collection.id).where(Collection.user_id == user_id,
                                                                 Collection.name == name))
        if taken is not None:
            raise ApiError(409, f"you already have a collection named {name!r}", "collection_exists", "name")
        row = Collection(user_id=user_id, name=name)
        session.add(row)
        await session.commit()
        return row

    async def collections(self, session: AsyncSession, user_id: str,
                          conversation_id: str | None = None) -> list[Collection]:
        """The user's collections (those attached to a conversation, when given)."""
        q = select(Collection).where(Collection.user_id == user_id)
        if conversation_id is not None:
            q = q.join(ConversationCollection, ConversationCollection.collection_id == Collection.id).where(
                ConversationCollection.conversation_id == conversation_id)
        return list((await session.scalars(q.order_by(Collection.name))).all())

    async def add_to_collection(self, session: AsyncSession, user_id: str, collection_id: str, file_id: str) -> None:
        await self.collection(session, user_id, collection_id)
        await self.get(session, user_id, file_id)
        if await session.get(CollectionFile, (collection_id, file_id)) is None:
            session.add(CollectionFile(collection_id=collection_id, file_id=file_id))
        await session.commit()

    async def attach(self, session: AsyncSession, user_id: str, conversation_id: str, file_id: str | None = None,
                     collection_id: str | None = None) -> None:
        """Attach one of the user's files or collections to a conversation (of theirs: the route checks)."""
        if file_id is not None:
            await self.get(session, user_id, file_id)
            if await session.get(ConversationFile, (conversation_id, file_id)) is None:
                session.add(ConversationFile(conversation_id=conversation_id, file_id=file_id))
        if collection_id is not None:
            await self.collection(session, user_id, collection_id)
            if await session.get(ConversationCollection, (conversation_id, collection_id)) is None:
                session.add(ConversationCollection(conversation_id=conversation_id, collection_id=collection_id))
        await session.commit()

    async def detach(self, session: AsyncSession, conversation_id: str, file_id: str | None = None,
                     collection_id: str | None = None) -> None:
        """Detach a file or collection from a conversation (of the caller's: the route checks); 404 when it
        was not attached there, which covers another user's ids (only the owner can attach them)."""
        if file_id is not None:
            done = await session.execute(delete(ConversationFile).where(
                ConversationFile.conversation_id == conversation_id, ConversationFile.file_id == file_id))
            if done.rowcount == 0:
                raise ApiError(404, "no such file is attached to this conversation", "file_not_found")
        if collection_id is not None:
            done = await session.execute(delete(ConversationCollection).where(
                ConversationCollection.conversation_id == conversation_id,
                ConversationCollection.collection_id == collection_id))
            if done.rowcount == 0:
                raise ApiError(404, "no such collection is attached to this conversation", "collection_not_found")
        await session.commit()

    async def scope(self, session: AsyncSession, user_id: str, conversation_id: str) -> list[str]:
        """The ids of the user's files a conversation reads: attached to it, or in a collection attached to it."""
        direct = select(ConversationFile.file_id).where(ConversationFile.conversation_id == conversation_id)
        via = select(CollectionFile.file_id).join(
            ConversationCollection, ConversationCollection.collection_id == CollectionFile.collection_id).where(
            ConversationCollection.conversation_id == conversation_id)
        q = select(StoredFile.id).where(StoredFile.user_id == user_id, StoredFile.id.in_(direct.union(via)))
        return list((await session.scalars(q)).all())

    # -- deleting for real ------------------------------------------------------------------------
    async def _remove(self, session: AsyncSession, rows: list[StoredFile]) -> int:
        """Delete files' rows (passages, text and attachments explicitly, not trusting ON DELETE CASCADE)
        and commit, then their blobs."""
        ids = [r.id for r in rows]
        if not ids:
            return 0
        for table, column in ((FileChunk, FileChunk.file_id), (FileText, FileText.file_id),
                              (ConversationFile, ConversationFile.file_id), (CollectionFile, CollectionFile.file_id)):
            await session.execute(delete(table).where(column.in_(ids)))
        await session.execute(delete(StoredFile).where(StoredFile.id.in_(ids)))
        await session.commit()
        for r in rows:
            await asyncio.to_thread(self.blobs.delete, r.blob_key)
        return len(ids)

    async def delete(self, session: AsyncSession, user_id: str, file_id: str) -> None:
        await self._remove(session, [await self.get(session, user_id, file_id)])

    def _held_elsewhere(self, conversation_id: str | None = None, collection_id: str | None = None):
        """A file attached to a conversation or collection other than the one being deleted."""
        other_conv = exists().where(ConversationFile.file_id == StoredFile.id,
                                    ConversationFile.conversation_id != (conversation_id or ""))
        other_coll = exists().where(CollectionFile.file_id == StoredFile.id,
                                    CollectionFile.collection_id != (collection_id or ""))
        return other_conv | other_coll

    async def delete_for_conversation(self, session: AsyncSession, user_id: str, conversation_id: str) -> int:
        """The files only this conversation held (uploaded into it, in no collection): removed with it."""
        mine = select(ConversationFile.file_id).where(ConversationFile.conversation_id == conversation_id)
        rows = (await session.scalars(select(StoredFile).where(
            StoredFile.user_id == user_id, StoredFile.id.in_(mine),
            ~self._held_elsewhere(conversation_id=conversation_id)))).all()
        return await self._remove(session, list(rows))

    async def delete_collection(self, session: AsyncSession, user_id: str, collection_id: str) -> int:
        """A collection, and the files no other collection or conversation holds."""
        await self.collection(session, user_id, collection_id)
        mine = select(CollectionFile.file_id).where(CollectionFile.collection_id == collection_id)
        rows = (await session.scalars(select(StoredFile).where(
            StoredFile.user_id == user_id, StoredFile.id.in_(mine),
            ~self._held_elsewhere(collection_id=collection_id)))).all()
        removed = await self._remove(session, list(rows))
        await session.execute(delete(ConversationCollection).where(
            ConversationCollection.collection_id == collection_id))
        await session.execute(delete(CollectionFile).where(CollectionFile.collection_id == collection_id))
        await session.execute(delete(Collection).where(Collection.id == collection_id))
        await session.commit()
        return removed

    async def delete_for_user(self, session: AsyncSession, user_id: str) -> int:
        """Every file of an account being deleted (whatever its purpose), and its collections."""
        rows = (await session.scalars(select(StoredFile).where(StoredFile.user_id == user_id))).all()
        removed = await self._remove(session, list(rows))
        colls = select(Collection.id).where(Collection.user_id == user_id)
        await session.execute(delete(ConversationCollection).where(ConversationCollection.collection_id.in_(colls)))
        await session.execute(delete(CollectionFile).where(CollectionFile.collection_id.in_(colls)))
        await session.execute(delete(Collection).where(Collection.user_id == user_id))
        await session.commit()
        return removed


def _clean_name(filename: str) -> str:
    """The name as shown: its last path segment, without control characters, at most 255 characters."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if ch.isprintable()).strip() or "upload"
    return name[:255]
