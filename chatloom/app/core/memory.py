"""Custom instructions and remembered facts: what a user keeps, and the part of the system prompt they
make. A memory the model proposes (the `remember` tool) waits as 'proposed' until the user confirms it;
only confirmed ('active') memories reach the prompt."""
from __future__ import annotations

from typing import Callable

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.core.errors import ApiError
from chatloom.settings import Settings
from chatloom.store import CustomInstructions, Memory
from chatloom.store.models import utcnow

INSTRUCTIONS_HEADER = "\n\nThe user's instructions for every answer:\n"
MEMORIES_HEADER = "\n\nWhat the user asked you to remember about them:\n"


async def instructions_of(session: AsyncSession, user_id: str) -> str:
    row = await session.get(CustomInstructions, user_id)
    return row.text if row else ""


async def set_instructions(session: AsyncSession, user_id: str, text: str) -> str:
    row = await session.get(CustomInstructions, user_id)
    if row is None:
        session.add(CustomInstructions(user_id=user_id, text=text, updated=utcnow()))
    else:
        row.text, row.updated = text, utcnow()
    await session.flush()
    return text


async def memories_of(session: AsyncSession, user_id: str, status: str | None = None) -> list[Memory]:
    """The user's memories, oldest first."""
    query = select(Memory).where(Memory.user_id == user_id)
    if status is not None:
        query = query.where(Memory.status == status)
    return list(await session.scalars(query.order_by(Memory.created, Memory.id)))


async def owned(session: AsyncSession, user_id: str, memory_id: str) -> Memory | None:
    return await session.scalar(select(Memory).where(Memory.id == memory_id, Memory.user_id == user_id))


async def add_memory(session: AsyncSession, settings: Settings, user_id: str, text: str, status: str = "active",
                     conversation_id: str | None = None) -> Memory:
    """A new memory; refused (409) when the user already keeps memory.max_memories."""
    text = check_text(text, settings.memory.max_memory_chars, "memory")
    count = await session.scalar(select(func.count()).select_from(Memory).where(Memory.user_id == user_id))
    if count >= settings.memory.max_memories:
        raise ApiError(409, f"you keep {count} memories, the most allowed; delete some first", "too_many_memories")
    now = utcnow()
    row = Memory(user_id=user_id, text=text, status=status, source_conversation_id=conversation_id, created=now,
                 updated=now)
    session.add(row)
    await session.flush()
    return row


def check_text(text: str, limit: int, what: str) -> str:
    text = text.strip()
    if not text:
        raise ApiError(400, f"the {what} is empty", "invalid_value", "text")
    if len(text) > limit:
        raise ApiError(400, f"the {what} is {len(text)} characters; at most {limit} are kept", "invalid_value",
                       "text")
    return text


def personal_prompt(instructions: str, memories: list[str], budget: int, count: Callable[[str], int]) -> str:
    """What the user's instructions and memories add to the system prompt, within `budget` tokens: the
    instructions first (cut to the budget when alone they exceed it), then the newest memories that fit."""
    out = _cut(INSTRUCTIONS_HEADER + instructions.strip(), budget, count) if instructions.strip() else ""
    chosen: list[str] = []
    for memory in reversed(memories):  # newest first: they are likelier to be what matters now
        candidate = MEMORIES_HEADER + "\n".join(f"- {m}" for m in [memory, *chosen])
        if count(out + candidate) > budget:
            break
        chosen.insert(0, memory)
    if chosen:
        out += MEMORIES_HEADER + "\n".join(f"- {m}" for m in chosen)
    return out


def _cut(text: str, budget: int, count: Callable[[str], int]) -> str:
    """The longest head of `text` within `budget` tokens (a binary search: few counts on long text)."""
    if count(text) <= budget:
        return text
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] if lo > len(INSTRUCTIONS_HEADER) else ""


async def system_prompt_for(session: AsyncSession, settings: Settings, user_id: str,
                            count: Callable[[str], int]) -> str:
    """The system prompt of the user's next answer: the server's, then their instructions and memories."""
    base = settings.chat.system_prompt
    if not settings.memory.enabled or settings.memory.prompt_budget_tokens == 0:
        return base
    memories = [m.text for m in await memories_of(session, user_id, "active")]
    return base + personal_prompt(await instructions_of(session, user_id), memories,
                                  settings.memory.prompt_budget_tokens, count)
