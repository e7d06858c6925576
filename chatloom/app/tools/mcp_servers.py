"""MCP servers as chat tools, through the official `mcp` SDK: each configured server's tools are
offered to the model as `SERVER__TOOL` with the server's own description and input schema, and a
call is passed to the server as it is.

Connections are short: a listing or a call opens its own session (a stdio server is started for it
and stopped after), so a server that crashed, hangs or was restarted costs one failed call, never a
stuck connection shared by later answers. Listings are reused for `mcp_list_ttl_s`. Whatever goes
wrong in a call (the server down, slow, killed mid-call, answering garbage or an error) becomes a
tool error the model reads; a server that cannot list its tools is left out of the answer's tools.

Servers come from the deployment's settings (tools.mcp_servers: stdio commands or URLs) and, where
tools.mcp_user_servers allows it, from users themselves (store/mcp.py): those are streamable HTTP
URLs only, and every request to them is held to the safe fetcher's address rules, checked at
connection time and pinned to the checked address (`PinnedTransport`), so a user cannot point the
gateway at its own network.
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
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.core.safe_fetch import FetchPolicy, FetchRefused, checked_address
from chatloom.app.generation.tool_calls import ToolSpec
from chatloom.app.tools.registry import Tool, ToolContext, ToolFailure
from chatloom.settings.tree import McpServerSettings, ToolsSettings
from chatloom.store import Database, User
from chatloom.store.mcp import UserMcpServer

log = logging.getLogger(__name__)

SEPARATOR = "__"
LIST_TIMEOUT_S = 10.0
_NAME = re.compile(r"[^A-Za-z0-9_-]")


class McpServer:
    """One configured server: its tools (listed, then reused a while) and calls to them."""

    def __init__(self, config: McpServerSettings, timeout_s: float, list_ttl_s: float,
                 policy: FetchPolicy | None = None) -> None:
        self.config = config
        self.policy = policy  # set: every request is held to the fetch rules (a user's server)
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
        transport = PinnedTransport(self.policy) if self.policy is not None else None
        http = httpx2.AsyncClient(headers=self.config.headers, timeout=self.timeout_s, transport=transport,
                                  trust_env=self.policy is None)
        return Client(streamable_http_client(self.config.url, http_client=http), read_timeout_seconds=self.timeout_s)

    async def tools(self) -> list[Tool]:
        """The server's tools as chat tools; [] (logged) when it cannot be listed."""
        async with self._lock:
            if time.monotonic() - self._listed_at < self._ttl:
                return self._tools
            try:
                self._tools = [tool for _, tool in await self.listing()]
                self._ttl = self.list_ttl_s
            except ToolFailure as exc:  # down, slow, garbage: its tools are not offered until it answers
                log.warning("MCP server %s: %s", self.name, exc)
                self._tools, self._ttl = [], self.list_ttl_s / 6
            self._listed_at = time.monotonic()
            return self._tools

    async def listing(self) -> list[tuple[dict, Tool]]:
        """The server's tools, listed now: each as the server describes it (name, description,
        input_schema) and as a chat tool; ToolFailure saying why it could not be listed."""
        try:
            async with asyncio.timeout(self.list_timeout_s):
                async with self._client() as client:
                    listed = (await client.list_tools()).tools
        except Exception as exc:
            raise ToolFailure(f"cannot list the tools of the MCP server {self.name}: "
                              f"{_reason(exc, self.list_timeout_s)}") from None
        return [({"name": t.name, "description": t.description, "input_schema": t.input_schema},
                 self._tool(t.name, t.description or "", t.input_schema)) for t in listed]

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


class PinnedTransport(httpx2.AsyncBaseTransport):
    """Sends each request to an address the fetch rules allow, checked when the request is made, with
    the host name kept in the Host header and the TLS server name (no DNS rebinding)."""

    def __init__(self, policy: FetchPolicy) -> None:
        self.policy = policy
        self.inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            parsed, address = await checked_address(str(request.url), self.policy)
        except FetchRefused as exc:
            raise httpx2.ConnectError(str(exc), request=request) from None
        request.url = request.url.copy_with(host=str(address))
        if parsed.scheme == "https":
            request.extensions = {**request.extensions, "sni_hostname": parsed.host}
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class McpTools:
    """Every configured server's tools, as a source of the tool registry (the same for every user)."""

    def __init__(self, settings: ToolsSettings) -> None:
        self.servers = [McpServer(c, settings.mcp_timeout_s, settings.mcp_list_ttl_s) for c in settings.mcp_servers]

    def __bool__(self) -> bool:
        return bool(self.servers)

    async def tools(self, user: User | None = None, session: AsyncSession | None = None) -> list[Tool]:
        listed = await asyncio.gather(*(s.tools() for s in self.servers))
        return [tool for tools in listed for tool in tools]


class UserMcpTools:
    """The tools of the servers the asking user added, held to the fetch rules (tools.fetch_allow applies)."""

    def __init__(self, settings: ToolsSettings, db: Database) -> None:
        self.settings = settings
        self.db = db
        self.policy = FetchPolicy(allow=tuple(settings.fetch_allow), timeout_s=settings.mcp_timeout_s)
        self._servers: dict[tuple, McpServer] = {}  # by (row id, url, headers): a changed row is a new server

    def __bool__(self) -> bool:
        return self.settings.mcp_user_servers

    async def tools(self, user: User | None, session: AsyncSession | None = None) -> list[Tool]:
        if user is None or not self.settings.mcp_user_servers:
            return []
        query = select(UserMcpServer).where(UserMcpServer.user_id == user.id).order_by(UserMcpServer.name)
        if session is not None:  # the request's own: no second connection while it holds one
            rows = (await session.execute(query)).scalars().all()
        else:
            async with self.db.session() as own:
                rows = (await own.execute(query)).scalars().all()
        servers = []
        for row in rows:
            key = (row.id, row.url, tuple(sorted(row.headers.items())))
            if key not in self._servers:
                config = McpServerSettings(name=row.name, url=row.url, headers=row.headers)
                self._servers[key] = McpServer(config, self.settings.mcp_timeout_s, self.settings.mcp_list_ttl_s,
                                               self.policy)
            servers.append(self._servers[key])
        listed = await asyncio.gather(*(s.tools() for s in servers))
        return [tool for tools in listed for tool in tools]
