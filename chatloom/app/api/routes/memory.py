"""Custom instructions and memories: what the caller wants every answer to know. The model may propose
a memory (the `remember` chat tool); it waits as 'proposed' until confirmed here."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Response

from chatloom.app.api.account_schemas import InstructionsIn, InstructionsOut, MemoryIn, MemoryOut
from chatloom.app.api.deps import Ctx, CurrentUser, SessionDep
from chatloom.app.api.openapi_responses import SIGNED_IN, errors
from chatloom.app.core import memory
from chatloom.app.core.errors import not_found
from chatloom.store import Memory
from chatloom.store.models import utcnow

router = APIRouter(tags=["memory"])


@router.get("/me/instructions", response_model=InstructionsOut, responses=SIGNED_IN)
async def read_instructions(user: CurrentUser, session: SessionDep) -> InstructionsOut:
    return InstructionsOut(text=await memory.instructions_of(session, user.id))


@router.put("/me/instructions", response_model=InstructionsOut, responses=errors(400, 401))
async def write_instructions(body: InstructionsIn, ctx: Ctx, user: CurrentUser, session: SessionDep) -> InstructionsOut:
    """Set the instructions added to the system prompt of every answer (empty: none)."""
    text = body.text.strip()
    if text:
        text = memory.check_text(text, ctx.settings.memory.max_instructions_chars, "instructions")
    await memory.set_instructions(session, user.id, text)
    await session.commit()
    return InstructionsOut(text=text)


@router.get("/memories", response_model=list[MemoryOut], responses=SIGNED_IN)
async def list_memories(user: CurrentUser, session: SessionDep,
                        status: Literal["active", "proposed"] | None = Query(None)) -> list[MemoryOut]:
    """The caller's memories, oldest first (?status=proposed: those waiting for confirmation)."""
    return [MemoryOut.of(m) for m in await memory.memories_of(session, user.id, status)]


@router.post("/memories", status_code=201, response_model=MemoryOut, responses=errors(400, 401, 409))
async def add_memory(body: MemoryIn, ctx: Ctx, user: CurrentUser, session: SessionDep) -> MemoryOut:
    row = await memory.add_memory(session, ctx.settings, user.id, body.text)
    await session.commit()
    return MemoryOut.of(row)


async def _owned(session: SessionDep, user_id: str, memory_id: str) -> Memory:
    row = await memory.owned(session, user_id, memory_id)
    if row is None:
        raise not_found("memory")
    return row


@router.patch("/memories/{memory_id}", response_model=MemoryOut, responses=errors(400, 401, 404))
async def edit_memory(memory_id: str, body: MemoryIn, ctx: Ctx, user: CurrentUser, session: SessionDep) -> MemoryOut:
    """Change a memory's text (a proposed one stays proposed)."""
    row = await _owned(session, user.id, memory_id)
    row.text = memory.check_text(body.text, ctx.settings.memory.max_memory_chars, "memory")
    row.updated = utcnow()
    await session.commit()
    return MemoryOut.of(row)


@router.post("/memories/{memory_id}/confirm", response_model=MemoryOut, responses=errors(401, 404))
async def confirm_memory(memory_id: str, user: CurrentUser, session: SessionDep) -> MemoryOut:
    """Accept a memory the model proposed: from now on it is in the prompt."""
    row = await _owned(session, user.id, memory_id)
    row.status, row.updated = "active", utcnow()
    await session.commit()
    return MemoryOut.of(row)


@router.delete("/memories/{memory_id}", status_code=204, responses=errors(401, 404))
async def delete_memory(memory_id: str, user: CurrentUser, session: SessionDep) -> Response:
    """Forget a memory (or decline a proposed one)."""
    await session.delete(await _owned(session, user.id, memory_id))
    await session.commit()
    return Response(status_code=204)
