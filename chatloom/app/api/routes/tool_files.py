"""The files the chat's tools produced (the code interpreter's files and plots), for download by
their owner: the browser shows images inline and offers the rest as downloads."""
from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from chatloom.app.api.deps import Ctx, CurrentUser, OwnedConversation, SessionDep
from chatloom.app.api.openapi_responses import OWN_CONVERSATION
from chatloom.app.core.errors import not_found
from chatloom.app.tools.code_interpreter import PURPOSE
from chatloom.store.blobs import BlobNotFound
from chatloom.store.models import StoredFile

router = APIRouter(prefix="/conversations", tags=["conversations"])


@router.get("/{conversation_id}/tool-files/{file_id}", response_class=StreamingResponse,
            responses=OWN_CONVERSATION | {200: {"content": {"application/octet-stream": {}}}})
async def tool_file(conversation: OwnedConversation, file_id: str, user: CurrentUser, session: SessionDep,
                    ctx: Ctx) -> StreamingResponse:
    """A file a tool wrote in one of the caller's conversations (404 for anyone else's)."""
    row = await session.get(StoredFile, file_id)
    if row is None or row.user_id != user.id or row.purpose != PURPOSE:
        raise not_found("file")
    try:
        chunks = ctx.blobs.iter_chunks(row.blob_key)
        first = next(chunks, b"")
    except BlobNotFound:
        raise not_found("file") from None
    kind = row.content_type or "application/octet-stream"
    inline = "inline" if kind == "image/png" else "attachment"
    plain = "".join(c for c in row.filename if c.isascii() and c.isprintable() and c not in '"\\') or "file"
    disposition = f"{inline}; filename=\"{plain}\"; filename*=UTF-8''{quote(row.filename, safe='')}"
    headers = {"Content-Disposition": disposition, "X-Content-Type-Options": "nosniff",
               "Content-Length": str(row.bytes)}

    def body():
        yield first
        yield from chunks

    return StreamingResponse(body(), media_type=kind, headers=headers)
