"""The built-in chat tools by name, as settings.chat.tools lists them.

The calculator, the clock and the search over past conversations need nothing; the code interpreter
(`python`) needs the settings' sandbox limits and a bubblewrap that works here, and `web_search` a
SearXNG URL: where they are missing, the tool is left out with a warning in the log, so the model is
never offered a tool that cannot run. `fetch_page` needs only the fetch settings. The tools of the
MCP servers in settings.tools.mcp_servers, and of the user's own where allowed, come on top, listed
when each answer starts, and so does `file_search` for a user who has files (files.search_tool).
"""
from __future__ import annotations

import logging
from typing import Callable

from chatloom.app.tools import calculator, clock, remember, search
from chatloom.app.files.retrieval import Retriever
from chatloom.app.tools.code_interpreter import CodeInterpreter
from chatloom.app.tools.file_search import FileSearchSource
from chatloom.app.tools.mcp_servers import McpTools, UserMcpTools
from chatloom.app.tools.registry import Tool, ToolRegistry
from chatloom.app.tools.web import WebTools
from chatloom.settings import Settings
from chatloom.store import Database

log = logging.getLogger(__name__)

BUILTINS = {"calculator": calculator.TOOL, "time": clock.TOOL, "search": search.TOOL, "remember": remember.TOOL}


def _python(settings: Settings) -> Tool | None:
    interpreter = CodeInterpreter(settings.tools, settings.server.data_dir)
    problem = interpreter.sandbox.problem()
    if problem:
        log.warning("the python tool is off: %s", problem)
        return None
    return interpreter.tool()


def _web_search(settings: Settings) -> Tool | None:
    if not settings.tools.search_url:
        log.warning("the web_search tool is off: settings.tools.search_url is not set")
        return None
    return WebTools(settings.tools).search_tool()


CONFIGURED: dict[str, Callable[[Settings], Tool | None]] = {
    "python": _python, "web_search": _web_search, "fetch_page": lambda s: WebTools(s.tools).fetch_tool()}


def builtin_registry(names: list[str], settings: Settings | None = None, db: Database | None = None,
                     retriever: Retriever | None = None) -> ToolRegistry:
    """A registry of the built-ins named, with file_search over `retriever`'s files; an unknown name is a
    configuration error (ValueError)."""
    known = [*BUILTINS, *CONFIGURED]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown chat tool(s) {', '.join(unknown)}; known: {', '.join(known)}")
    tools = []
    for name in names:
        if name in BUILTINS:
            tools.append(BUILTINS[name])
        elif (tool := CONFIGURED[name](settings or Settings())) is not None:
            tools.append(tool)
    sources = [McpTools(settings.tools)] if settings is not None else []
    if settings is not None and db is not None:
        sources.append(UserMcpTools(settings.tools, db))
    if retriever is not None:
        sources.append(FileSearchSource(retriever))
    return ToolRegistry(tools, sources)
