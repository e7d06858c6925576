"""A real MCP server for the tests, written with the official SDK: `python mcp_test_server.py stdio`
or `python mcp_test_server.py http PORT`. Its `vault_code` tool answers with a code derived from a
secret only this process knows (MCP_TEST_SECRET), so a chat answer that contains the code shows the
call went through the server. `hang` writes the server's pid to a file and waits, for killing it
mid-call; `slow` writes its pid and sleeps (asynchronously: the server keeps answering others), for a
call that runs past the caller's timeout; `header` echoes an HTTP request header (the configured
headers reach the server)."""
from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time

from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("vault")


@server.tool()
def vault_code(label: str) -> str:
    """The vault's code for a label."""
    digest = hashlib.sha256(f"{os.environ['MCP_TEST_SECRET']}:{label}".encode()).hexdigest()[:12]
    return f"vault code for {label}: {digest}"


@server.tool()
def hang(pid_file: str) -> str:
    """Write this server's pid to a file, then wait (for a minute)."""
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
    return "woke up"


@server.tool()
async def slow(seconds: float, pid_file: str) -> str:
    """Write this server's pid to a file, then sleep for some seconds."""
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    await asyncio.sleep(seconds)
    return f"slept {seconds:g} s"


@server.tool()
def header(name: str, ctx: Context) -> str:
    """The value of an HTTP request header of this call."""
    request = ctx.request_context.request
    return f"{name}: {request.headers.get(name) if request is not None else None}"


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]), stateless_http=True)
