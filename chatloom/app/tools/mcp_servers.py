"""MCP servers as chat tools, through the official `mcp` SDK: each configured server's tools are
offered to the model as `SERVER__TOOL` with the server's own description and input schema, and a
call is passed to the server as it is.

Connections are short: a listing or a call opens its own session (a stdio server is started for it
and stopped after), so a server that crashed, hangs or was restarted costs one failed call, never a
stuck connection shared by later answers. Listings are reused for `mcp_list_ttl_s`. Whatever goes
wrong in a call (the server down, slow, killed mid-call, answering garbage or an error) becomes a
tool error the model reads; a server that cannot list its tools is left out of the answer's tools.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import httpx2
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from chatloom.app.generation.tool_calls import ToolSpec
from chatloom.app.tools.registry import Tool, ToolContext, ToolFailure
from chatloom.settings.tree import McpServerSettings, ToolsSettings

log = logging.getLogger(__name__)

SEPARATOR = "__"
LIST_TIMEOUT_S = 10.0
_NAME = re.compile(r"[^A-Za-z0-9_-]")


class McpServer:
    """One configured server: its tools (listed, then reused a while) and calls to them."""

    def __init__(self, config: McpServerSettings, timeout_s: float, list_ttl_s: float) -> None:
        self.config = config
        self.name = config.name
        self.timeout_s = timeout_s
        self.list_timeout_s = min(timeout_s, LIST_TIMEOUT_S)  # an answer waits for the listing before it starts
        self.list_ttl_s = list_ttl_s
        self._tools: list[Tool] = []
        self._listed_at = float("-inf")
        self._ttl = 0.0
        self._lock = asyncio.Lock()

    def _client(self) -> Client:
        if self.config.command is not None:
            command, *args = self.config.command
            return Client(StdioServerParameters(command=command, args=args, env=self.config.env or None),
                          read_timeout_seconds=self.timeout_s)
        http = httpx2.AsyncClient(headers=self.config.headers, timeout=self.timeout_s)
        return Client(streamable_http_client(self.config.url, http_client=http), read_timeout_seconds=self.timeout_s)

    async def tools(self) -> list[Tool]:
        """The server's tools as chat tools; [] (logged) when it cannot be listed."""
        async with self._lock:
            if time.monotonic() - self._listed_at < self._ttl:
                return self._tools
            try:
                async with asyncio.timeout(self.list_timeout_s):
                    async with self._client() as client:
                        listed = (await client.list_tools()).tools
                self._tools = [self._tool(t.name, t.description or "", t.input_schema) for t in listed]
                self._ttl = self.list_ttl_s
            except Exception as exc:  # down, slow, garbage: its tools are not offered until it answers
                log.warning("MCP server %s: cannot list its tools: %s", self.name, _reason(exc, self.list_timeout_s))
                self._tools, self._ttl = [], self.list_ttl_s / 6
            self._listed_at = time.monotonic()
            return self._tools

    def _tool(self, name: str, description: str, schema: dict | None) -> Tool:
        exposed = f"{self.name}{SEPARATOR}{_NAME.sub('_', name)}"[:64]
        parameters = schema if isinstance(schema, dict) and schema.get("type") == "object" else {
            "type": "object", "properties": {}}

        async def run(args: dict, ctx: ToolContext) -> str:
            return await self.call(name, args)

        spec = ToolSpec(exposed, f"{description} (from the MCP server {self.name})".strip(), parameters)
        # The server checks its own arguments against its schema; the timeout here backs up the call's own.
        return Tool(spec, run, timeout_s=self.timeout_s + 5, check_args=False)

    async def call(self, name: str, args: dict) -> str:
        """The text of a call's result; ToolFailure for anything that went wrong."""
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._client() as client:
                    result = await client.call_tool(name, args)
        except Exception as exc:
            raise ToolFailure(f"the MCP server {self.name} failed: {_reason(exc, self.timeout_s)}") from None
        text = _result_text(result)
        if getattr(result, "is_error", False):
            raise ToolFailure(f"the MCP server {self.name} answered with an error: {text[:1000]}")
        return text


def _result_text(result: object) -> str:
    """A call result's content as text: text parts as they are, other parts named."""
    parts = []
    for item in getattr(result, "content", None) or []:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        else:
            parts.append(f"[{kind or 'unknown'} content]")
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts) or "(no content)"


def _reason(exc: BaseException, timeout_s: float) -> str:
    """One line for an error, looking inside the exception groups the SDK's task groups raise."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, MCPError):
        return f"{exc}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class McpTools:
    """Every configured server's tools, as a source of the tool registry."""

    def __init__(self, settings: ToolsSettings) -> None:
        self.servers = [McpServer(c, settings.mcp_timeout_s, settings.mcp_list_ttl_s) for c in settings.mcp_servers]

    def __bool__(self) -> bool:
        return bool(self.servers)

    async def tools(self) -> list[Tool]:
        listed = await asyncio.gather(*(s.tools() for s in self.servers))
        return [tool for tools in listed for tool in tools]
