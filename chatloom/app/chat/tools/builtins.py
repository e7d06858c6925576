"""The built-in chat tools by name, as settings.chat.tools lists them."""
from __future__ import annotations

from chatloom.app.chat.tools import calculator, clock, remember, search
from chatloom.app.chat.tools.registry import ToolRegistry

BUILTINS = {"calculator": calculator.TOOL, "time": clock.TOOL, "search": search.TOOL, "remember": remember.TOOL}


def builtin_registry(names: list[str]) -> ToolRegistry:
    """A registry of the built-ins named; an unknown name is a configuration error (ValueError)."""
    unknown = [n for n in names if n not in BUILTINS]
    if unknown:
        raise ValueError(f"unknown chat tool(s) {', '.join(unknown)}; known: {', '.join(BUILTINS)}")
    return ToolRegistry([BUILTINS[n] for n in names])
