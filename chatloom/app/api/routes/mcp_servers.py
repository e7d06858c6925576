"""A user's own MCP servers (when settings.tools.mcp_user_servers allows them): list, add, remove.
Their tools join the chat's tools from the next answer on (app/tools/mcp_servers.py)."""
from __future__ import annotations

import re

from fastapi import APIRouter, Response
from pydantic import BaseModel, Field
from sqlalchemy import func, select

from chatloom.app.api.deps import Ctx, CurrentUser, SessionDep
from chatloom.app.api.openapi_responses import SIGNED_IN, errors
from chatloom.app.core.errors import ApiError, not_found
from chatloom.app.core.safe_fetch import FetchPolicy, FetchRefused, checked_address
from chatloom.store.mcp import UserMcpServer

router = APIRouter(prefix="/mcp-servers", tags=["tools"])

_HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")


class McpServerIn(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,32}$", description="The model sees the server's tools as NAME__TOOL.")
    url: str = Field(max_length=2048, description="The server's streamable HTTP endpoint (http or https).")
    headers: dict[str, str] = Field({}, max_length=16, description="Sent with every request (an API token).")


class McpServerOut(BaseModel):
    id: str
    name: str
    url: str
    header_names: list[str]  # the values (tokens) are never sent back

    @classmethod
    def of(cls, row: UserMcpServer) -> "McpServerOut":
        return cls(id=row.id, name=row.name, url=row.url, header_names=sorted(row.headers))


def _allowed(ctx: Ctx) -> None:
    if not ctx.settings.tools.mcp_user_servers:
        raise ApiError(403, "this server does not let users add MCP servers", "mcp_servers_disabled")


@router.get("", response_model=list[McpServerOut], responses=SIGNED_IN | errors(403))
async def list_servers(user: CurrentUser, session: SessionDep, ctx: Ctx) -> list[McpServerOut]:
    _allowed(ctx)
    rows = await session.execute(select(UserMcpServer).where(UserMcpServer.user_id == user.id)
                                 .order_by(UserMcpServer.name))
    return [McpServerOut.of(r) for r in rows.scalars()]


@router.post("", status_code=201, response_model=McpServerOut, responses=SIGNED_IN | errors(400, 403, 409))
async def add_server(body: McpServerIn, user: CurrentUser, session: SessionDep, ctx: Ctx) -> McpServerOut:
    """Add a server; its URL must be reachable under the fetch rules (no private addresses)."""
    _allowed(ctx)
    settings = ctx.settings.tools
    for key, value in body.headers.items():
        if not _HEADER_NAME.match(key) or any(c in value for c in "\r\n\0") or len(value) > 4096:
            raise ApiError(400, f"bad header {key[:64]!r}", "invalid_value", "headers")
    if body.name in {s.name for s in settings.mcp_servers}:
        raise ApiError(409, f"the name {body.name!r} is taken by a server of this deployment", "name_taken", "name")
    try:
        await checked_address(body.url, FetchPolicy(allow=tuple(settings.fetch_allow)))
    except FetchRefused as exc:
        raise ApiError(400, f"url: {exc}", "invalid_value", "url") from None
    mine = UserMcpServer.user_id == user.id
    if (await session.execute(select(UserMcpServer.id).where(mine, UserMcpServer.name == body.name))).first():
        raise ApiError(409, f"you already have an MCP server named {body.name!r}", "name_taken", "name")
    count = (await session.execute(select(func.count()).select_from(UserMcpServer).where(mine))).scalar_one()
    if count >= settings.mcp_user_max_servers:
        raise ApiError(409, f"at most {settings.mcp_user_max_servers} MCP servers per user", "too_many", "name")
    row = UserMcpServer(user_id=user.id, name=body.name, url=body.url, headers=body.headers)
    session.add(row)
    await session.commit()
    return McpServerOut.of(row)


@router.delete("/{server_id}", status_code=204, responses=SIGNED_IN | errors(403, 404))
async def remove_server(server_id: str, user: CurrentUser, session: SessionDep, ctx: Ctx) -> Response:
    _allowed(ctx)
    row = await session.get(UserMcpServer, server_id)
    if row is None or row.user_id != user.id:
        raise not_found("MCP server")
    await session.delete(row)
    await session.commit()
    return Response(status_code=204)
