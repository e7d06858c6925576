"""OpenAI's files API: /v1/files upload (multipart: `file`, `purpose`), list, retrieve, content, delete.

Rows live in the shared `files` table and bytes in the blob store (store/files.py keeps the two
together). Each purpose has its own size limit ([files] max_bytes): a larger upload is a 413 naming the
limit, and nothing is stored. A `vision` upload must be an image that a request could use (the chat
path's checks, core/image_input.py): else a 400 naming the problem, and nothing is stored. Another
user's file is a 404, as if it did not exist.
"""
from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import StreamingResponse

from chatloom.app.api.batch_schemas import FileDeleted, FileList, FileOut
from chatloom.app.api.deps import Ctx, CurrentUser, SessionDep
from chatloom.app.api.openapi_responses import errors
from chatloom.app.core.errors import ApiError, not_found
from chatloom.app.core.image_input import ImageReader, reading_images
from chatloom.settings.tree import VisionSettings
from chatloom.store.blobs import BlobNotFound, BlobTooLarge
from chatloom.store.files import StoredFiles
from chatloom.store.models import FILE_PURPOSES

router = APIRouter(prefix="/v1", tags=["files"])

# What a client may upload (batch_output files are written by the server).
UPLOAD_PURPOSES = tuple(p for p in FILE_PURPOSES if p != "batch_output")


def _file_not_found(file_id: str) -> ApiError:
    return ApiError(404, f"no file with id {file_id!r}", "file_not_found", "file_id")


@router.post("/files", response_model=FileOut, responses=errors(400, 401, 413, 503))
async def upload_file(ctx: Ctx, user: CurrentUser, session: SessionDep, file: Annotated[UploadFile, File()],
                      purpose: Annotated[str, Form()]) -> FileOut:
    """Upload a file for a purpose: `batch` for a Batch API input (JSONL), or any other of OpenAI's."""
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, not {purpose!r}",
                       "invalid_value", "purpose")
    limit = ctx.settings.files.limit(purpose)
    if file.size is not None and file.size > limit:
        raise _too_large(file.size, limit, purpose)
    try:
        data, content_type = file.file, file.content_type
        if purpose == "vision":  # refused now, not when a request first uses it
            data, content_type = await _vision_image(ctx.settings.vision, file, limit)
        row = await StoredFiles(session, ctx.blobs).save(user.id, file.filename or "upload", purpose, data,
                                                         max_bytes=limit, content_type=content_type)
    except BlobTooLarge:
        raise _too_large(file.size, limit, purpose) from None
    finally:
        await file.close()
    return FileOut.of(row)


async def _vision_image(settings: VisionSettings, file: UploadFile, limit: int) -> tuple[bytes, str]:
    """The upload's bytes and media type, sniffed from its content with the chat path's image checks;
    400 naming the problem (not an image, corrupt, too many bytes or pixels), 413 past the purpose's limit."""
    data = await file.read(limit + 1)
    if len(data) > limit:
        raise _too_large(None, limit, "vision")
    image = await reading_images(True, ImageReader(settings, "file").check, data,
                                 "the file (purpose vision)")
    return data, image.media_type


def _too_large(size: int | None, limit: int, purpose: str) -> ApiError:
    size_text = f"is {size} bytes" if size is not None else "is larger than that"
    return ApiError(413, f"the file {size_text}; files for purpose {purpose!r} may be at most {limit} bytes",
                    "file_too_large", "file")


@router.get("/files", response_model=FileList, responses=errors(401))
async def list_files(ctx: Ctx, user: CurrentUser, session: SessionDep, purpose: str | None = None,
                     after: str | None = Query(None, max_length=40), limit: int = Query(100, ge=1, le=10_000),
                     order: Literal["asc", "desc"] = "desc") -> FileList:
    """The caller's files, newest first (order=asc: oldest first), `limit` at a time after the file `after`."""
    rows = await StoredFiles(session, ctx.blobs).page(user.id, purpose, after, limit + 1, newest_first=order == "desc")
    data = [FileOut.of(r) for r in rows[:limit]]
    return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                    has_more=len(rows) > limit)


@router.get("/files/{file_id}", response_model=FileOut, responses=errors(401, 404))
async def get_file(file_id: str, ctx: Ctx, user: CurrentUser, session: SessionDep) -> FileOut:
    row = await StoredFiles(session, ctx.blobs).get_owned(user.id, file_id)
    if row is None:
        raise _file_not_found(file_id)
    return FileOut.of(row)


@router.get("/files/{file_id}/content", response_class=StreamingResponse, responses=errors(401, 404))
async def file_content(file_id: str, ctx: Ctx, user: CurrentUser, session: SessionDep) -> StreamingResponse:
    """The file's bytes, streamed from the blob store."""
    row = await StoredFiles(session, ctx.blobs).get_owned(user.id, file_id)
    if row is None:
        raise _file_not_found(file_id)
    try:
        ctx.blobs.open(row.blob_key).close()  # a missing blob is a 404 now, not a broken stream later
    except BlobNotFound:
        raise not_found("file content") from None
    return StreamingResponse(ctx.blobs.iter_chunks(row.blob_key),
                             media_type=row.content_type or "application/octet-stream",
                             headers={"Content-Length": str(row.bytes),
                                      "Content-Disposition": f'attachment; filename="{_safe(row.filename)}"'})


def _safe(name: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "_" for c in name)


@router.delete("/files/{file_id}", response_model=FileDeleted, responses=errors(401, 404))
async def delete_file(file_id: str, ctx: Ctx, user: CurrentUser, session: SessionDep) -> FileDeleted:
    files = StoredFiles(session, ctx.blobs)
    row = await files.get_owned(user.id, file_id)
    if row is None:
        raise _file_not_found(file_id)
    await files.delete(row)
    return FileDeleted(id=file_id)
