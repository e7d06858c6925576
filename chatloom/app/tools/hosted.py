"""The built-in tool types of the OpenAI-shaped APIs, run on the server with the chat's own tools:
`web_search` (tools/web.py), `file_search` over the user's collections (tools/file_search.py),
`code_interpreter` in the bubblewrap sandbox (tools/code_interpreter.py) and `mcp`, a streamable HTTP
MCP server the request names (tools/mcp_servers.py, held to the fetch rules as a user's own server).

`HostedToolbox` is built once per gateway; each request asks it for the tools it names and gets
`HostedTool`s, or a 400 naming what is missing: the type turned off (tools.api_tools), or what it runs
on absent (no search_url, no working bubblewrap, user MCP servers not allowed). The API room turns the
request's tool objects into these calls, and the calls' results into the API's output items.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.core.errors import ApiError
from chatloom.app.core.safe_fetch import FetchPolicy
from chatloom.app.files.retrieval import Retriever
from chatloom.app.generation.tool_calls import ToolSpec
from chatloom.app.tools.code_interpreter import CodeInterpreter
from chatloom.app.tools.file_search import FileSearch
from chatloom.app.tools.mcp_servers import McpServer
from chatloom.app.tools.registry import Tool, ToolFailure, ToolRegistry
from chatloom.app.tools.web import WebTools
from chatloom.settings import Settings
from chatloom.settings.tree import McpServerSettings
from chatloom.store.file_chunks import Collection

MAX_MCP_SERVERS = 5  # per request: each is listed before the answer starts


@dataclass(frozen=True)
class HostedTool:
    kind: str  # web_search | file_search | code_interpreter | mcp
    tool: Tool
    label: str | None = None  # mcp: the request's server_label
    remote_name: str | None = None  # mcp: the server's own name for the tool

    @property
    def name(self) -> str:
        """The name the model calls it by."""
        return self.tool.spec.name


@dataclass(frozen=True)
class McpListing:
    """An MCP server's tools as listed for a request (what the mcp_list_tools item shows)."""

    label: str
    tools: list[dict]


@dataclass
class HostedTools:
    """The built-in tools of one request, by the names the model calls them."""

    tools: dict[str, HostedTool] = field(default_factory=dict)
    listings: list[McpListing] = field(default_factory=list)

    def add(self, tool: HostedTool, param: str) -> None:
        if tool.name in self.tools:
            raise ApiError(400, f"two tools would be called {tool.name!r}; give each tool of the request a "
                           "distinct type or name", "invalid_value", param)
        self.tools[tool.name] = tool

    def __bool__(self) -> bool:
        return bool(self.tools)

    def specs(self) -> list[ToolSpec]:
        return [t.tool.spec for t in self.tools.values()]

    def registry(self) -> ToolRegistry:
        return ToolRegistry([t.tool for t in self.tools.values()])


class HostedToolbox:
    """What this gateway can run for the APIs; one per app."""

    def __init__(self, settings: Settings, retriever: Retriever | None) -> None:
        self.settings = settings
        self.web = WebTools(settings.tools)
        self.code = CodeInterpreter(settings.tools, settings.server.data_dir)
        self.files = FileSearch(retriever) if retriever is not None else None
        tools = settings.tools
        self.mcp_policy = FetchPolicy(allow=tuple(tools.fetch_allow), timeout_s=tools.mcp_timeout_s)

    def _enabled(self, kind: str, param: str) -> None:
        if kind not in self.settings.tools.api_tools:
            raise ApiError(400, f"the {kind} tool is turned off on this server (tools.api_tools)",
                           "unsupported_value", param)

    def web_search(self, param: str) -> HostedTool:
        self._enabled("web_search", param)
        if not self.settings.tools.search_url:
            raise ApiError(400, "web_search is not configured on this server: it has no search service "
                           "(tools.search_url)", "unsupported_value", param)
        return HostedTool("web_search", self.web.search_tool())

    def code_interpreter(self, param: str) -> HostedTool:
        self._enabled("code_interpreter", param)
        problem = self.code.sandbox.problem()
        if problem:
            raise ApiError(400, f"code_interpreter cannot run on this server: {problem}", "unsupported_value",
                           param)
        return HostedTool("code_interpreter", self.code.tool())

    async def file_search(self, session: AsyncSession, user_id: str, collection_ids: list[str],
                          param: str, limit: int | None = None) -> HostedTool:
        """Search over the user's collections (the request's vector stores); 400 for one not theirs."""
        self._enabled("file_search", param)
        if self.files is None:
            raise ApiError(400, "file_search is not configured on this server", "unsupported_value", param)
        if not collection_ids:
            raise ApiError(400, f"{param}.vector_store_ids must name at least one vector store (a collection's "
                           "id)", "invalid_value", param)
        owned = set((await session.scalars(select(Collection.id).where(
            Collection.user_id == user_id, Collection.id.in_(collection_ids)))).all())
        for i, cid in enumerate(collection_ids):
            if cid not in owned:  # another user's is unknown, exactly as one that does not exist
                raise ApiError(400, f"{param}.vector_store_ids[{i}]: you have no vector store (collection) "
                               f"{cid!r}", "invalid_value", param)
        return HostedTool("file_search", self.files.tool(list(dict.fromkeys(collection_ids)), limit=limit))

    async def mcp(self, label: str, url: str, headers: dict[str, str], allowed: list[str] | None,
                  param: str) -> tuple[McpListing, list[HostedTool]]:
        """A request's MCP server: listed now (424 if that fails), its allowed tools as hosted tools."""
        self._enabled("mcp", param)
        if not self.settings.tools.mcp_user_servers:
            raise ApiError(400, "MCP servers named in requests are not allowed on this server "
                           "(tools.mcp_user_servers)", "unsupported_value", param)
        try:
            config = McpServerSettings(name=label, url=url, headers=headers)
        except ValidationError as exc:
            raise ApiError(400, f"{param}.server_label must be 1 to 32 letters, digits, '_' or '-' "
                           f"({exc.errors()[0]['msg']})", "invalid_value", param) from None
        if not url.startswith(("http://", "https://")):
            raise ApiError(400, f"{param}.server_url must be an http or https URL", "invalid_value", param)
        tools = self.settings.tools
        server = McpServer(config, tools.mcp_timeout_s, 0.0, self.mcp_policy)
        try:
            listed = await server.listing()
        except ToolFailure as exc:
            raise ApiError(424, f"{param}: {exc}", "mcp_server_unavailable", param) from None
        if allowed is not None:
            listed = [(info, tool) for info, tool in listed if info["name"] in allowed]
        return (McpListing(label, [info for info, _ in listed]),
                [HostedTool("mcp", tool, label, info["name"]) for info, tool in listed])
