"""Export and import: one conversation or all of them as JSON (every branch) or Markdown (the active
branch); an import of chatloom's own export or of ChatGPT's conversations.json.

Included before the conversations router, so /conversations/export is not read as a conversation id."""
from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from chatloom.app.api.account_schemas import ExportFile, ImportOut
from chatloom.app.api.deps import Ctx, CurrentUser, OwnedConversation, SessionDep
from chatloom.app.api.openapi_responses import errors
from chatloom.app.chat import exporting, importing
from chatloom.app.core.errors import ApiError

router = APIRouter(prefix="/conversations", tags=["export and import"])

IMPORT_PATH = "/conversations/import"
Format = Literal["json", "markdown"]
EXPORTED = {200: {"description": "JSON (chatloom's export format, every branch) or Markdown (the active branch), "
                                 "as a download.",
                  "model": ExportFile, "content": {"text/markdown": {"schema": {"type": "string"}}}}}


def _download(items, fmt: Format, name: str) -> Response:
    if fmt == "markdown":
        return Response(exporting.export_markdown(items), media_type="text/markdown; charset=utf-8",
                        headers={"Content-Disposition": f'attachment; filename="{name}.md"'})
    return JSONResponse(exporting.export_json(items),
                        headers={"Content-Disposition": f'attachment; filename="{name}.json"'})


@router.get("/export", response_model=ExportFile, responses=EXPORTED | errors(401))
async def export_all(user: CurrentUser, session: SessionDep, format: Format = Query("json")) -> Response:
    """All the caller's conversations, newest first."""
    return _download(await exporting.load(session, user.id), format, "chatloom-conversations")


@router.get("/{conversation_id}/export", response_model=ExportFile, responses=EXPORTED | errors(401, 404))
async def export_one(conv: OwnedConversation, user: CurrentUser, session: SessionDep,
                     format: Format = Query("json")) -> Response:
    return _download(await exporting.load(session, user.id, conv.id), format, f"chatloom-{conv.id}")


@router.post(IMPORT_PATH.removeprefix("/conversations"), status_code=201, response_model=ImportOut,
             responses=errors(400, 401, 413),
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
                 "description": "chatloom's export (see ExportFile) or ChatGPT's conversations.json "
                                "(a list of conversations with a `mapping` tree)",
                 "oneOf": [{"$ref": "#/components/schemas/ExportFile"}, {"type": "array", "items": {"type": "object"}}],
             }}}}})
async def import_conversations(request: Request, ctx: Ctx, user: CurrentUser, session: SessionDep) -> ImportOut:
    """Import conversations as new ones of the caller, keeping each tree, its roles and timestamps. The
    whole file is checked first; a file that is not what it claims is refused (400) and nothing is stored.
    Larger than portability.import_max_bytes: 413."""
    limits = ctx.settings.portability
    raw = await request.body()
    if len(raw) > limits.import_max_bytes:
        raise ApiError(413, f"the import file is {len(raw)} bytes; at most {limits.import_max_bytes} are accepted",
                       "request_too_large", "file")
    found, convs = await asyncio.to_thread(importing.parse, raw, limits.import_max_messages)
    await asyncio.to_thread(importing.count_tokens, convs, ctx.backend.count_tokens)
    ids = await importing.store(session, user.id, convs)
    await session.commit()
    return ImportOut(format=found, conversation_ids=ids, messages=sum(len(c.nodes) for c in convs))
