"""The model proposes a fact about the user to remember; it is kept as 'proposed' and reaches later
prompts only once the user confirms it (POST /memories/{id}/confirm, or the settings panel)."""
from __future__ import annotations

from chatloom.app.core.memory import add_memory
from chatloom.app.tools.registry import Tool, ToolContext, ToolFailure
from chatloom.app.core.errors import ApiError
from chatloom.app.generation.tool_calls import ToolSpec
from chatloom.settings import Settings


async def _run(args: dict, ctx: ToolContext) -> str:
    async with ctx.db.session() as session:
        try:
            memory = await add_memory(session, ctx.settings or Settings(), ctx.user.id, args["fact"],
                                      status="proposed", conversation_id=ctx.conversation_id)
        except ApiError as exc:
            raise ToolFailure(exc.message) from None
        await session.commit()
    return f"proposed memory {memory.id}; the user will be asked to confirm it"


TOOL = Tool(ToolSpec("remember", "Propose a lasting fact about the user (a preference, their name, their work) to "
                                 "remember in later conversations; the user confirms it first.",
                     {"type": "object", "properties": {"fact": {"type": "string"}},
                      "required": ["fact"], "additionalProperties": False}), _run)
