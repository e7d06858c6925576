"""The built-in tool objects of a Responses request (`tools: [{"type": "web_search"}, ...]`), read into the
tools the server runs (app/tools/hosted.py):

    {"type": "web_search"}  (or web_search_preview; search_context_size and user_location are accepted, unused)
    {"type": "file_search", "vector_store_ids": [collection ids], "max_num_results": n}
    {"type": "code_interpreter", "container": {"type": "auto"}}
    {"type": "mcp", "server_label": "...", "server_url": "https://...", "allowed_tools": [...],
     "require_approval": "never", "headers": {...}, "authorization": "token"}

A vector store is one of the caller's collections: its id is the collection's id. Anything this server
cannot honour (a named container, a connector, approvals) is a 400 naming it.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.core.errors import ApiError
from chatloom.app.tools.hosted import MAX_MCP_SERVERS, HostedToolbox, HostedTools

LENIENT = ConfigDict(extra="ignore")
WEB_SEARCH_TYPES = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11")
HOSTED_TYPES = (*WEB_SEARCH_TYPES, "file_search", "code_interpreter", "mcp")
SECRET_FIELDS = ("headers", "authorization")  # never echoed back in the response object


class FileSearchToolIn(BaseModel):
    model_config = LENIENT
    type: Literal["file_search"]
    vector_store_ids: list[str] = Field(max_length=16)
    max_num_results: int | None = Field(default=None, ge=1, le=50)


class CodeInterpreterToolIn(BaseModel):
    model_config = LENIENT
    type: Literal["code_interpreter"]
    container: str | dict[str, Any]


class McpToolIn(BaseModel):
    model_config = LENIENT
    type: Literal["mcp"]
    server_label: str
    server_url: str | None = None
    connector_id: str | None = None
    allowed_tools: list[str] | dict[str, Any] | None = None
    require_approval: str | dict[str, Any] | None = None
    headers: dict[str, str] | None = None
    authorization: str | None = None

    def allowed(self) -> list[str] | None:
        if isinstance(self.allowed_tools, dict):
            names = self.allowed_tools.get("tool_names")
            return [str(n) for n in names] if isinstance(names, list) else None
        return self.allowed_tools


def is_hosted(raw: dict) -> bool:
    return raw.get("type") in HOSTED_TYPES


def shown(raw: dict) -> dict:
    """A built-in tool as the response object echoes it (no credentials)."""
    return {k: v for k, v in raw.items() if k not in SECRET_FIELDS}


def _read(model: type[BaseModel], raw: dict, param: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ApiError(400, f"{param}.{where}: {err['msg']}", "invalid_value", "tools") from None


async def hosted_tools(tools: list[dict], toolbox: HostedToolbox | None, session: AsyncSession,
                       user_id: str) -> HostedTools:
    """The request's built-in tools, checked and (for MCP) listed; 400 for one this server cannot run."""
    out = HostedTools()
    servers = 0
    for i, raw in enumerate(tools):
        kind, param = raw.get("type"), f"tools[{i}]"
        if kind not in HOSTED_TYPES:
            continue
        if toolbox is None:
            raise ApiError(400, f"{param}: built-in tools are not available on this server", "unsupported_value",
                           "tools")
        if kind in WEB_SEARCH_TYPES:
            out.add(toolbox.web_search(param), "tools")
        elif kind == "file_search":
            body = _read(FileSearchToolIn, raw, param)
            out.add(await toolbox.file_search(session, user_id, body.vector_store_ids, param, body.max_num_results),
                    "tools")
        elif kind == "code_interpreter":
            body = _read(CodeInterpreterToolIn, raw, param)
            if not isinstance(body.container, dict) or body.container.get("type") != "auto":
                raise ApiError(400, f"{param}.container: only {{\"type\": \"auto\"}} is supported (a fresh "
                               "container for the response)", "unsupported_value", "tools")
            if body.container.get("file_ids"):
                raise ApiError(400, f"{param}.container.file_ids: files cannot be put in the container",
                               "unsupported_value", "tools")
            out.add(toolbox.code_interpreter(param), "tools")
        else:
            body = _read(McpToolIn, raw, param)
            servers += 1
            if servers > MAX_MCP_SERVERS:
                raise ApiError(400, f"at most {MAX_MCP_SERVERS} MCP servers per request", "invalid_value", "tools")
            if body.connector_id is not None or not body.server_url:
                raise ApiError(400, f"{param}: connectors are not supported; give a server_url", "unsupported_value",
                               "tools")
            if body.require_approval != "never":
                raise ApiError(400, f"{param}.require_approval must be \"never\": this server runs MCP tools "
                               "without asking for approval", "unsupported_value", "tools")
            if any(t.label == body.server_label for t in out.tools.values()) or \
                    any(listing.label == body.server_label for listing in out.listings):
                raise ApiError(400, f"{param}.server_label {body.server_label!r} is used twice", "invalid_value",
                               "tools")
            headers = dict(body.headers or {})
            if body.authorization:
                headers["Authorization"] = f"Bearer {body.authorization}"
            await session.close()  # no database connection held while the server is listed
            listing, found = await toolbox.mcp(body.server_label, body.server_url, headers, body.allowed(), param)
            out.listings.append(listing)
            for tool in found:
                out.add(tool, "tools")
    return out
