"""The product's files API (/files; the OpenAI-shaped /v1/files is routes/files.py): upload, list, read and
conversations; searching them. A translation over app/files/ (the behaviour lives there).

Every id is checked against the caller: another user's file, collection or conversation is a 404,
the same answer as for one that does not exist.
"""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, File, Form, Query, Response, UploadFile
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from chatloom.app.api.deps import Ctx, CurrentUser, OwnedConversation, SessionDep
from chatloom.app.api.file_schemas import (AttachedOut, AttachIn, CollectionIn, CollectionOut, FileOut, FileRef,
                                           FileTextOut, PassageOut)
from chatloom.app.api.openapi_responses import SIGNED_IN, errors
from chatloom.app.core.errors import ApiError, not_found
from chatloom.store import Conversations
from chatloom.store.file_chunks import FileChunk

router = APIRouter(tags=["files"])
UPLOAD = errors(400, 401, 404, 413, 415, 422, 503)
OWN = errors(401, 404)


@router.post("/files", status_code=201, response_model=FileOut, responses=UPLOAD)
async def upload_file(ctx: Ctx, user: CurrentUser, session: SessionDep, file: UploadFile = File(...),
                      conversation_id: str | None = Form(None), collection_id: str | None = Form(None)) -> FileOut:
    """Upload a PDF, DOCX, Markdown, HTML, source or text file (the type is read from the content): its
    text is extracted, cut into passages and indexed for retrieval; optionally attached to one of the
    caller's conversations or collections."""
    conv = coll = None
    if conversation_id is not None:
        conv = await Conversations(session).get_owned(user.id, conversation_id)
        if conv is None:
            raise not_found("conversation")
    if collection_id is not None:
        coll = await ctx.files.collection(session, user.id, collection_id)
    limit = ctx.files.max_file_bytes(user)
    data = await file.read(limit + 1)
    if len(data) > limit:
        raise ApiError(413, f"the file is larger than the limit of {limit} bytes", "file_too_large", "file")
    await session.close()  # the upload's own sessions do the writing; this one holds nothing
    return FileOut.of(await ctx.files.upload(user, file.filename or "upload", data, conv, coll))


@router.get("/files", response_model=list[FileOut], responses=OWN)
async def list_files(ctx: Ctx, user: CurrentUser, session: SessionDep, conversation_id: str | None = None,
                     collection_id: str | None = None) -> list[FileOut]:
    if conversation_id is not None and await Conversations(session).get_owned(user.id, conversation_id) is None:
        raise not_found("conversation")
    if collection_id is not None:
        await ctx.files.collection(session, user.id, collection_id)
    return [FileOut.of(f) for f in await ctx.files.list(session, user.id, conversation_id, collection_id)]


@router.get("/files/search", response_model=list[PassageOut], responses=OWN)
async def search_files(ctx: Ctx, user: CurrentUser, session: SessionDep, q: str = Query(min_length=1, max_length=2000),
                       mode: Literal["hybrid", "fulltext", "vector"] = "hybrid", limit: int = Query(5, ge=1, le=50),
                       conversation_id: str | None = None) -> list[PassageOut]:
    """The caller's passages best matching `q` (all their files, or those a conversation reads)."""
    if conversation_id is not None:
        if await Conversations(session).get_owned(user.id, conversation_id) is None:
            raise not_found("conversation")
        file_ids = await ctx.files.scope(session, user.id, conversation_id)
    else:
        file_ids = [f.id for f in await ctx.files.list(session, user.id)]
    ids = await ctx.retriever.search(user, file_ids, q, mode, limit)
    rows = {c.id: c for c in await session.scalars(select(FileChunk).where(FileChunk.id.in_(ids),
                                                                          FileChunk.user_id == user.id))}
    return [PassageOut.of(rows[i]) for i in ids if i in rows]


@router.get("/files/{file_id}", response_model=FileOut, responses=OWN)
async def read_file(file_id: str, ctx: Ctx, user: CurrentUser, session: SessionDep) -> FileOut:
    return FileOut.of(await ctx.files.get(session, user.id, file_id))


@router.get("/files/{file_id}/text", response_model=FileTextOut, responses=OWN)
async def file_text(file_id: str, ctx: Ctx, user: CurrentUser, session: SessionDep) -> FileTextOut:
    """The text extracted from the file (a citation's char_start/char_end point into it)."""
    return FileTextOut.of(*await ctx.files.text(session, user.id, file_id))


@router.get("/files/{file_id}/passages", response_model=list[PassageOut], responses=OWN)
async def file_passages(file_id: str, ctx: Ctx, user: CurrentUser, session: SessionDep) -> list[PassageOut]:
    return [PassageOut.of(c) for c in await ctx.files.chunks(session, user.id, file_id)]


@router.get("/files/{file_id}/content", response_class=StreamingResponse, responses=OWN)
async def file_content(file_id: str, ctx: Ctx, user: CurrentUser, session: SessionDep) -> StreamingResponse:
    """The file's bytes as uploaded."""
    row = await ctx.files.get(session, user.id, file_id)
    return StreamingResponse(ctx.blobs.iter_chunks(row.blob_key), media_type=row.content_type or
                             "application/octet-stream", headers={"Content-Disposition": "attachment",
                                                                  "X-Content-Type-Options": "nosniff"})


@router.delete("/files/{file_id}", status_code=204, responses=OWN)
async def delete_file(file_id: str, ctx: Ctx, user: CurrentUser, session: SessionDep) -> Response:
    """Remove the file for good: its row, text, passages, vectors, attachments and bytes."""
    await ctx.files.delete(session, user.id, file_id)
    return Response(status_code=204)


# -- collections ----------------------------------------------------------------------------------
@router.post("/collections", status_code=201, response_model=CollectionOut, responses=errors(401, 409, 422))
async def create_collection(body: CollectionIn, ctx: Ctx, user: CurrentUser, session: SessionDep) -> CollectionOut:
    return CollectionOut.of(await ctx.files.create_collection(session, user.id, body.name.strip()))


@router.get("/collections", response_model=list[CollectionOut], responses=SIGNED_IN)
async def list_collections(ctx: Ctx, user: CurrentUser, session: SessionDep) -> list[CollectionOut]:
    return [CollectionOut.of(c) for c in await ctx.files.collections(session, user.id)]


@router.post("/collections/{collection_id}/files", status_code=204, responses=errors(401, 404, 422))
async def add_to_collection(collection_id: str, body: FileRef, ctx: Ctx, user: CurrentUser,
                            session: SessionDep) -> Response:
    await ctx.files.add_to_collection(session, user.id, collection_id, body.file_id)
    return Response(status_code=204)


@router.delete("/collections/{collection_id}", status_code=204, responses=OWN)
async def delete_collection(collection_id: str, ctx: Ctx, user: CurrentUser, session: SessionDep) -> Response:
    """Remove the collection, and the files in it that no other collection or conversation holds."""
    await ctx.files.delete_collection(session, user.id, collection_id)
    return Response(status_code=204)


# -- a conversation's files -------------------------------------------------------------------------
@router.get("/conversations/{conversation_id}/files", response_model=AttachedOut, responses=OWN)
async def conversation_files(conv: OwnedConversation, ctx: Ctx, user: CurrentUser, session: SessionDep) -> AttachedOut:
    files = await ctx.files.list(session, user.id, conversation_id=conv.id)
    colls = await ctx.files.collections(session, user.id, conversation_id=conv.id)
    return AttachedOut(files=[FileOut.of(f) for f in files], collections=[CollectionOut.of(c) for c in colls])


@router.post("/conversations/{conversation_id}/files", status_code=204, responses=errors(401, 404, 422))
async def attach(body: AttachIn, conv: OwnedConversation, ctx: Ctx, user: CurrentUser, session: SessionDep) -> Response:
    """Attach one of the caller's files or collections: the conversation's answers retrieve from it."""
    await ctx.files.attach(session, user.id, conv.id, body.file_id, body.collection_id)
    return Response(status_code=204)


@router.delete("/conversations/{conversation_id}/files/{file_id}", status_code=204, responses=OWN)
async def detach_file(file_id: str, conv: OwnedConversation, ctx: Ctx, session: SessionDep) -> Response:
    await ctx.files.detach(session, conv.id, file_id=file_id)
    return Response(status_code=204)


@router.delete("/conversations/{conversation_id}/collections/{collection_id}", status_code=204, responses=OWN)
async def detach_collection(collection_id: str, conv: OwnedConversation, ctx: Ctx, session: SessionDep) -> Response:
    await ctx.files.detach(session, conv.id, collection_id=collection_id)
    return Response(status_code=204)
