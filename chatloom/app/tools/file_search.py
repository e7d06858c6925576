"""`file_search`: retrieval over the user's own files as a tool the model calls with a query.

The passages come from the same search as the automatic retrieval (files/retrieval.py) and come back
numbered, each with its file name and page, continuing the numbers the answer already cites
(`ToolContext.citations`): the passages join the answer's `citations` in the same shape, so "[3]" in
the answer opens the third cited passage whether the prompt or the tool brought it. A passage cited
already keeps its number.

What is searched: in the chat, the files the conversation reads (attached, or in an attached
collection), or one of the user's collections the model names, or, when the conversation has none
attached, all of the user's files; on the APIs, the collections the request named (its vector stores).
Only the asking user's files and collections are ever searched; another user's collection is as
unknown as one that does not exist. In the chat the tool is offered once the user has files
(`files.search_tool` turns it off).
"""
from __future__ import annotations

from dataclasses import asdict

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.files.retrieval import Passage, Retriever
from chatloom.app.files.service import PURPOSE
from chatloom.app.generation.tool_calls import ToolSpec
from chatloom.app.tools.registry import Tool, ToolContext, ToolFailure, ToolOutput
from chatloom.store import User
from chatloom.store.file_chunks import Collection, CollectionFile, FileChunk
from chatloom.store.models import StoredFile

NAME = "file_search"
MAX_QUERY_CHARS = 1000
MAX_COLLECTIONS_LISTED = 20
DESCRIPTION = ("Search the user's uploaded files for passages about a query. The passages come back numbered; "
               "cite them by number like [1].")


class FileSearch:
    """The tool over a retriever; `tool()` for the chat, `tool(collection_ids)` for an API request."""

    def __init__(self, retriever: Retriever) -> None:
        self.retriever = retriever
        self.settings = retriever.settings

    def tool(self, collection_ids: list[str] | None = None, collections: list[str] | None = None,
             limit: int | None = None) -> Tool:
        """The tool; `collection_ids`: search only these (the caller checked they are the user's own);
        `collections`: the user's collection names, offered to the model as a choice (chat only);
        `limit`: passages at most (default: files.top_k)."""
        props: dict = {"query": {"type": "string", "description": "What to look for, in a few words."}}
        description = DESCRIPTION
        if collection_ids is None:
            props["collection"] = {"type": "string", "description": "Search only this collection of the "
                                                                    "user's (its name); default: the files of "
                                                                    "this conversation."}
            if collections:
                description += " The user's collections: " + ", ".join(collections[:MAX_COLLECTIONS_LISTED]) + "."
        spec = ToolSpec(NAME, description, {"type": "object", "properties": props, "required": ["query"],
                                            "additionalProperties": False})

        async def run(args: dict, ctx: ToolContext) -> ToolOutput:
            return await self.run(args, ctx, collection_ids, limit)

        # The passages are fitted to files.prompt_tokens; characters are bounded by that, not by the default.
        return Tool(spec, run, timeout_s=30.0, max_output_chars=max(16_000, 8 * self.settings.files.prompt_tokens))

    async def run(self, args: dict, ctx: ToolContext, collection_ids: list[str] | None,
                  limit: int | None = None) -> ToolOutput:
        query = args["query"].strip()
        if not query:
            raise ToolFailure("the query is empty")
        if len(query) > MAX_QUERY_CHARS:
            raise ToolFailure(f"the query is too long (at most {MAX_QUERY_CHARS} characters)")
        async with ctx.db.session() as session:
            file_ids = await self._scope(session, ctx, collection_ids, args.get("collection"))
            ids = await self.retriever.search(ctx.user, file_ids, query, limit=limit, session=session) \
                if file_ids else []
            passages = await self._passages(session, ctx, ids)
        if not file_ids:
            raise ToolFailure("there are no files to search")
        if not passages:
            return ToolOutput("no passages of the files match the query", {"query": query, "citations": []})
        text = "\n\n".join(f"{p['heading']}:\n{p['text'].strip()}" for p in passages)
        return ToolOutput(text, {"query": query, "citations": [p["n"] for p in passages]})

    async def _scope(self, session: AsyncSession, ctx: ToolContext, collection_ids: list[str] | None,
                     collection: str | None) -> list[str]:
        """The ids of the user's files this call searches."""
        user_id = ctx.user.id
        if collection_ids is not None:
            return await _in_collections(session, user_id, collection_ids)
        if collection is not None:
            found = await session.scalar(select(Collection.id).where(
                Collection.user_id == user_id, or_(Collection.name == collection, Collection.id == collection)))
            if found is None:
                raise ToolFailure(f"the user has no collection named {collection!r}")
            return await _in_collections(session, user_id, [found])
        files = self.retriever.files
        attached = await files.scope(session, user_id, ctx.conversation_id) if ctx.conversation_id else []
        if attached:
            return attached
        return list((await session.scalars(select(StoredFile.id).where(
            StoredFile.user_id == user_id, StoredFile.purpose == PURPOSE))).all())

    async def _passages(self, session: AsyncSession, ctx: ToolContext, ids: list[int]) -> list[dict]:
        """The found passages that fit files.prompt_tokens, numbered after those the answer cites already
        (which keep their numbers); each added to ctx.citations when new."""
        if not ids:
            return []
        rows = (await session.execute(select(FileChunk, StoredFile.filename).join(
            StoredFile, StoredFile.id == FileChunk.file_id).where(FileChunk.id.in_(ids),
                                                                  FileChunk.user_id == ctx.user.id))).all()
        by_id = {chunk.id: (chunk, name) for chunk, name in rows}
        cited = {c["chunk_id"]: c for c in ctx.citations}
        count = self.retriever.backend.count_tokens
        budget, used, out = self.settings.files.prompt_tokens, 0, []
        for chunk_id in ids:
            if chunk_id not in by_id:
                continue
            chunk, name = by_id[chunk_id]
            old = cited.get(chunk_id)
            n = old["n"] if old else len(ctx.citations) + 1
            p = Passage(n, chunk.file_id, name, chunk.id, chunk.ordinal, chunk.page, chunk.char_start,
                        chunk.char_end, chunk.text)
            cost = count(f"\n\n{p.heading()}:\n{p.text.strip()}")
            if used + cost > budget:
                continue  # a shorter passage further down may still fit
            used += cost
            if old is None:
                ctx.citations.append(asdict(p))
            out.append({**asdict(p), "heading": p.heading()})
        return out


async def _in_collections(session: AsyncSession, user_id: str, collection_ids: list[str]) -> list[str]:
    q = (select(StoredFile.id).join(CollectionFile, CollectionFile.file_id == StoredFile.id)
         .join(Collection, Collection.id == CollectionFile.collection_id)
         .where(StoredFile.user_id == user_id, Collection.user_id == user_id,
                CollectionFile.collection_id.in_(collection_ids)).distinct())
    return list((await session.scalars(q)).all())


class FileSearchSource:
    """The chat's `file_search`, offered to a user who has files (a source of the tool registry). Whether
    they have files is read in the asking request's session where there is one (registry.ToolSource)."""

    def __init__(self, retriever: Retriever) -> None:
        self.search = FileSearch(retriever)

    def __bool__(self) -> bool:
        return self.search.settings.files.search_tool

    async def tools(self, user: User | None, session: AsyncSession | None = None) -> list[Tool]:
        if user is None or not self:
            return []
        names = await self._look_up(user.id, session)
        return [] if names is None else [self.search.tool(collections=names)]

    async def _look_up(self, user_id: str, session: AsyncSession | None) -> list[str] | None:
        if session is None:
            async with self.search.retriever.files.db.session() as own:
                return await self._look_up(user_id, own)
        files = await session.scalar(select(func.count()).select_from(StoredFile).where(
            StoredFile.user_id == user_id, StoredFile.purpose == PURPOSE))
        if not files:
            return None
        return list((await session.scalars(select(Collection.name).where(Collection.user_id == user_id)
                                           .order_by(Collection.name).limit(MAX_COLLECTIONS_LISTED))).all())
