"""Passages of a conversation's files for a new message: found, fused, fitted to a token budget, cited.

`Retriever.for_conversation` looks only at the files the conversation reads (attached to it, or in an
attached collection) and only at the asking user's own: full-text and, where the passages have vectors,
nearest neighbours of the message's embedding (embedded through the pipeline's embed path, or by the
remote embedding server of `files.embeddings_url`), fused by
rank (search.py). The best passages are kept while they fit `files.prompt_tokens`; `context_text` is
what the prompt's system message gains, and `citations` what the answer message keeps, numbered as the
prompt numbers them, so an answer's "[2]" opens the second passage.
"""
from __future__ import annotations

import contextlib

import logging
from dataclasses import asdict, dataclass
from typing import AsyncIterator

from sqlalchemy import select
from sqlalchemy.orm import load_only
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.core.errors import ApiError
from chatloom.app.files.search import fulltext, fuse, nearest
from chatloom.app.files.service import Files
from chatloom.serving import Backend, BackendError, BadGenerationRequest
from chatloom.store import User
from chatloom.store.file_chunks import FileChunk
from chatloom.store.models import StoredFile

log = logging.getLogger(__name__)

CONTEXT_HEADER = ("\n\nExcerpts from the user's files follow. Use them to answer when they are relevant, and "
                  "cite them by number like [1].")
CANDIDATES = 20  # ranked by each method before fusing


@dataclass(frozen=True)
class Passage:
    n: int  # its number in the prompt, from 1
    file_id: str
    filename: str
    chunk_id: int
    ordinal: int
    page: int | None
    char_start: int
    char_end: int
    text: str

    def heading(self) -> str:
        return f"[{self.n}] {self.filename}" + (f", page {self.page}" if self.page else "")


def context_text(passages: list[Passage]) -> str:
    """What the system message gains: the header and each passage under its number."""
    if not passages:
        return ""
    return CONTEXT_HEADER + "".join(f"\n\n{p.heading()}:\n{p.text.strip()}" for p in passages)


def citations(passages: list[Passage]) -> list[dict] | None:
    return [asdict(p) for p in passages] or None


class Retriever:
    def __init__(self, files: Files, backend: Backend) -> None:
        self.files = files
        self.backend = backend
        self.settings = files.settings

    async def search(self, user: User, file_ids: list[str], query: str, mode: str = "hybrid",
                     limit: int | None = None, session: AsyncSession | None = None) -> list[int]:
        """Passage ids of `file_ids` for `query`, best first: "fulltext", "vector" or "hybrid" (fused).
        `session`: the caller's, used instead of a connection of its own."""
        limit = limit or self.settings.files.top_k
        found = None
        if self._embeds(mode):
            # Before any connection is held: the question's embedding may wait in the admission queue.
            found = await self._query_vector(user, query)
        rankings: list[list[int]] = []
        weights: list[float] = []
        async with self._session(session) as s:
            if mode in ("fulltext", "hybrid"):
                rankings.append(await fulltext(s, user.id, file_ids, query, CANDIDATES))
                weights.append(1.0)
            if found is not None:
                model, vector = found
                rankings.append(await nearest(s, user.id, file_ids, vector, model, CANDIDATES,
                                             self.files.db.vector_search))
                # Alone (mode "vector") its order is all there is, whatever its weight.
                weights.append(self.settings.files.fusion_weight() if weights else 1.0)
        return fuse(rankings, self.settings.files.rrf_k, weights)[:limit]

    def _embeds(self, mode: str) -> bool:
        return mode in ("vector", "hybrid") and self.settings.files.embeddings

    @contextlib.asynccontextmanager
    async def _session(self, session: AsyncSession | None) -> AsyncIterator[AsyncSession]:
        """The caller's session, or one of our own: a request answering a message already holds one
        connection, and a second per request runs the pool dry under a burst."""
        if session is not None:
            yield session
        else:
            async with self._reading() as own:
                yield own

    @contextlib.asynccontextmanager
    async def _reading(self) -> AsyncIterator[AsyncSession]:
        """A session of our own that only reads, outside a transaction: no BEGIN and ROLLBACK round trips
        around the searches (on a loaded machine each cost as much as the search). A passage deleted
        between two of its statements is skipped, as one deleted before."""
        async with self.files.db.session() as own:
            await own.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
            yield own

    async def _query_vector(self, user: User, query: str) -> tuple[str, list[float]] | None:
        try:
            model, result = await self.files.embedder.embed(user, [query], self.settings.files.embedding_model)
        except (ApiError, BadGenerationRequest, BackendError) as exc:  # full-text alone still answers
            log.warning("retrieval without vectors, full-text search only: %s", exc)
            return None
        return model, result.vectors[0]

    async def for_conversation(self, user: User, conversation_id: str, query: str,
                               session: AsyncSession | None = None, mode: str = "hybrid") -> list[Passage]:
        """The passages for a new message in a conversation, within the prompt budget; [] without files.
        `session`: the caller's, used instead of a connection of its own; `mode`: as for `search`."""
        budget = self.settings.files.prompt_tokens
        if budget <= 0 or not query.strip():
            return []
        if session is None and not self._embeds(mode):  # nothing to wait for: one connection throughout
            async with self._reading() as own:
                return await self.for_conversation(user, conversation_id, query, own, mode)
        async with self._session(session) as s:
            file_ids = await self.files.scope(s, user.id, conversation_id)
        if not file_ids:
            return []
        ids = await self.search(user, file_ids, query, mode, session=session)
        if not ids:
            return []
        async with self._session(session) as s:
            # The columns a passage needs, not its vector.
            rows = (await s.execute(select(FileChunk, StoredFile.filename).options(
                load_only(FileChunk.id, FileChunk.file_id, FileChunk.ordinal, FileChunk.page, FileChunk.char_start,
                          FileChunk.char_end, FileChunk.text)).join(
                StoredFile, StoredFile.id == FileChunk.file_id).where(FileChunk.id.in_(ids),
                                                                      FileChunk.user_id == user.id))).all()
        by_id = {chunk.id: (chunk, name) for chunk, name in rows}
        passages: list[Passage] = []
        used = self.backend.count_tokens(CONTEXT_HEADER)
        for chunk_id in ids:
            if chunk_id not in by_id:
                continue
            chunk, name = by_id[chunk_id]
            p = Passage(len(passages) + 1, chunk.file_id, name, chunk.id, chunk.ordinal, chunk.page,
                        chunk.char_start, chunk.char_end, chunk.text)
            cost = self.backend.count_tokens(f"\n\n{p.heading()}:\n{p.text.strip()}")
            if used + cost > budget:
                continue  # a shorter passage further down may still fit
            passages.append(p)
            used += cost
        return passages
