"""The registry of chat tools: each tool's spec (what the model is told) and its function.

A tool never raises into the orchestrator: bad arguments, a failure inside the tool or an output
that is too large come back as a `ToolResult` with `error` set, which the model and the user see
as the step's result. One user's tool call touches only that user's data (`ToolContext.user`).
A tool may return `ToolOutput` instead of text, with `details` the browser shows beside the step
(the code interpreter's code, output and files); they are stored with the step, never read by the model.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.generation.tool_calls import ToolCall, ToolSpec, ToolUse
from chatloom.settings import Settings
from chatloom.store import Database, User
from chatloom.store.blobs import BlobStore

log = logging.getLogger(__name__)

MAX_OUTPUT_CHARS = 4000  # a result longer than this is refused, not fed to the model
TIMEOUT_S = 5.0
MAX_USERS_LISTED = 10_000  # users whose listed tools are kept (an answer needs them while it runs)


class ToolFailure(Exception):
    """A tool's own refusal (bad arguments, nothing found); the message goes to the model as the result,
    after any `output` the tool still has to show (a failed program's own output)."""

    def __init__(self, message: str, output: str = "", details: dict | None = None) -> None:
        super().__init__(message)
        self.output = output
        self.details = details


@dataclass(frozen=True)
class ToolOutput:
    """A result with details for the browser beside the text the model reads."""

    text: str
    details: dict | None = None


@dataclass(frozen=True)
class ToolContext:
    user: User
    db: Database
    conversation_id: str
    blobs: BlobStore | None = None  # where a tool keeps the files it produces (the files table's store)
    settings: Settings | None = None  # for the tools with limits of their own (remember: the memory group)
    # The passages the answer cites so far, numbered from 1 (files/retrieval.py's shape): file_search adds
    # the ones it finds, and the answer keeps the list as its `citations`.
    citations: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class ToolResult:
    call: ToolCall
    output: str = ""
    error: str | None = None
    details: dict | None = None

    def event(self) -> dict:
        event = {"id": self.call.id, "name": self.call.name, "output": self.output, "error": self.error}
        if self.details is not None:
            event["details"] = self.details
        return event

    def model_text(self) -> str:
        """What the model reads back in the tool turn."""
        if not self.error:
            return self.output
        return f"{self.output}\nerror: {self.error}" if self.output else f"error: {self.error}"


@dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    run: Callable[[dict, ToolContext], Awaitable[str | ToolOutput]]
    timeout_s: float = TIMEOUT_S
    max_output_chars: int = MAX_OUTPUT_CHARS
    check_args: bool = True  # False: the tool checks its own arguments (an MCP server, against its schema)


class ToolSource(Protocol):
    """Tools that come and go (MCP servers'): listed again, for the user asking, when an answer starts.
    `session` is the asking request's own database session, for a source that reads the database: a
    request must never wait for a second connection of the pool while it holds one (a burst of such
    requests would hold every connection and wait out the pool's timeout)."""

    async def tools(self, user: User, session: AsyncSession | None = None) -> list[Tool]: ...


class ToolRegistry:
    def __init__(self, tools: list[Tool], sources: list[ToolSource] | None = None) -> None:
        self.tools = {t.spec.name: t for t in tools}
        self.sources = [s for s in sources or [] if s]
        # Each user's tools from the sources at their last listing (users may have servers of their own).
        self._listed: OrderedDict[str | None, dict[str, Tool]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self.tools) or bool(self.sources)

    def tool_use(self, user: User | None = None) -> ToolUse:
        listed = self._listed.get(_key(user), {})
        specs = [t.spec for t in self.tools.values()]
        specs += [t.spec for name, t in listed.items() if name not in self.tools]
        return ToolUse(tuple(specs), "auto", parallel=True)

    async def refresh(self, user: User | None = None, session: AsyncSession | None = None) -> ToolUse:
        """List the sources' tools again for this user (each source reuses a recent listing); all offered.
        With the request's `session`, the sources read the database in it, one after another (a session
        runs one statement at a time)."""
        if self.sources:
            if session is None:
                listed = await asyncio.gather(*(s.tools(user) for s in self.sources))
            else:
                listed = [await s.tools(user, session) for s in self.sources]
            found: dict[str, Tool] = {}
            for tool in (t for tools in listed for t in tools):
                found.setdefault(tool.spec.name, tool)  # the first source wins a name: the deployment's
            self._listed[_key(user)] = found
            self._listed.move_to_end(_key(user))
            while len(self._listed) > MAX_USERS_LISTED:
                self._listed.popitem(last=False)
        return self.tool_use(user)

    async def run(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        tool = self.tools.get(call.name) or self._listed.get(_key(ctx.user if ctx else None), {}).get(call.name)
        if tool is None:
            return ToolResult(call, error=f"unknown tool {call.name!r}")
        try:
            args = json.loads(call.arguments)
            if tool.check_args:
                _check_args(args, tool.spec.parameters)
            elif not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
            async with asyncio.timeout(tool.timeout_s):
                output = await tool.run(args, ctx)
        except ToolFailure as exc:
            return ToolResult(call, exc.output[:tool.max_output_chars], str(exc), exc.details)
        except (ValueError, TypeError) as exc:
            return ToolResult(call, error=f"bad arguments: {exc}")
        except asyncio.TimeoutError:
            return ToolResult(call, error=f"the tool took longer than {tool.timeout_s:g} s")
        except Exception:  # a bug in a tool must not end the answer
            log.exception("tool %s failed", call.name)
            return ToolResult(call, error="the tool failed")
        if isinstance(output, str):
            output = ToolOutput(output)
        if len(output.text) > tool.max_output_chars:
            return ToolResult(call, error=f"the tool's output is too large ({len(output.text)} characters, "
                                          f"at most {tool.max_output_chars})")
        return ToolResult(call, output.text, details=output.details)


def _key(user: User | None) -> str | None:
    return user.id if user is not None else None


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
        kind = props[key].get("type")
        if kind == "string" and not isinstance(value, str):
            raise ValueError(f"{key} must be a string")
        if kind == "integer" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{key} must be an integer")

