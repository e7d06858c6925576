"""The current date and time, in UTC or a named time zone (the model cannot know it otherwise)."""
from __future__ import annotations

from datetime import datetime, timezone
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from chatloom.app.generation.tool_calls import ToolSpec
from chatloom.app.tools.registry import Tool, ToolContext, ToolFailure


async def _run(args: dict, ctx: ToolContext) -> str:
    name = args.get("timezone") or "UTC"
    try:
        zone = timezone.utc if name.upper() == "UTC" else ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ToolFailure(f"unknown time zone {name!r} (use a name like Europe/Paris)") from None
    now = datetime.now(zone)
    return f"{now.strftime('%A %Y-%m-%d %H:%M:%S')} {name}"


TOOL = Tool(ToolSpec("time", "The current date and time, in UTC or in a time zone such as Europe/Paris.",
                     {"type": "object", "properties": {"timezone": {"type": "string"}},
                      "additionalProperties": False}), _run)
