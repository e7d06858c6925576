"""The registry of chat tools: each tool's spec (what the model is told) and its function.

A tool never raises into the orchestrator: bad arguments, a failure inside the tool or an output
that is too large come back as a `ToolResult` with `error` set, which the model and the user see
as the step's result. One user's tool call touches only that user's data (`ToolContext.user`).
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from chatloom.app.generation.tool_calls import ToolCall, ToolSpec, ToolUse
from chatloom.settings import Settings
from chatloom.store import Database, User

log = logging.getLogger(__name__)

MAX_OUTPUT_CHARS = 4000  # a result longer than this is refused, not fed to the model
TIMEOUT_S = 5.0


class ToolFailure(Exception):
    """A tool's own refusal (bad arguments, nothing found); the message goes to the model as the result."""


@dataclass(frozen=True)
class ToolContext:
    user: User
    db: Database
    conversation_id: str
    settings: Settings | None = None  # for the tools with limits of their own (remember: the memory group)


@dataclass(frozen=True)
class ToolResult:
    call: ToolCall
    output: str = ""
    error: str | None = None

    def event(self) -> dict:
        return {"id": self.call.id, "name": self.call.name, "output": self.output, "error": self.error}

    def model_text(self) -> str:
        """What the model reads back in the tool turn."""
        return f"error: {self.error}" if self.error else self.output


@dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    run: Callable[[dict, ToolContext], Awaitable[str]]


class ToolRegistry:
    def __init__(self, tools: list[Tool]) -> None:
        self.tools = {t.spec.name: t for t in tools}

    def __bool__(self) -> bool:
        return bool(self.tools)

    def tool_use(self) -> ToolUse:
        return ToolUse(tuple(t.spec for t in self.tools.values()), "auto", parallel=True)

    async def run(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call, error=f"unknown tool {call.name!r}")
        try:
            args = json.loads(call.arguments)
            _check_args(args, tool.spec.parameters)
            output = await asyncio.wait_for(tool.run(args, ctx), TIMEOUT_S)
        except ToolFailure as exc:
            return ToolResult(call, error=str(exc))
        except (ValueError, TypeError) as exc:
            return ToolResult(call, error=f"bad arguments: {exc}")
        except asyncio.TimeoutError:
            return ToolResult(call, error=f"the tool took longer than {TIMEOUT_S:g} s")
        except Exception:  # a bug in a tool must not end the answer
            log.exception("tool %s failed", call.name)
            return ToolResult(call, error="the tool failed")
        if len(output) > MAX_OUTPUT_CHARS:
            return ToolResult(call, error=f"the tool's output is too large ({len(output)} characters, "
                                          f"at most {MAX_OUTPUT_CHARS})")
        return ToolResult(call, output)


def _check_args(args: Any, schema: dict) -> None:
    """The few schema rules the built-ins use: an object, required keys, no unknown keys, string types."""
    if not isinstance(args, dict):
        raise ValueError("arguments must be a JSON object")
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    unknown = [k for k in args if k not in props]
    if unknown:
        raise ValueError(f"unknown argument {', '.join(unknown)}")
    for key, value in args.items():
        if props[key].get("type") == "string" and not isinstance(value, str):
            raise ValueError(f"{key} must be a string")

