"""The Responses API's built-in tool calls as output items and stream events, in OpenAI's shapes:

    web_search_call        response.web_search_call.in_progress, .searching, .completed
    file_search_call       response.file_search_call.in_progress, .searching, .completed
    code_interpreter_call  response.code_interpreter_call.in_progress, response.code_interpreter_call_code.delta,
                           .code.done, response.code_interpreter_call.interpreting, .completed
    mcp_call               response.mcp_call.in_progress, response.mcp_call_arguments.delta, .done,
                           response.mcp_call.completed or .failed
    mcp_list_tools         response.mcp_list_tools.in_progress, .completed (at the start, one per server)

each between response.output_item.added and response.output_item.done. What `include` asks for is added:
file_search_call.results, web_search_call.action.sources, code_interpreter_call.outputs.

A stored item keeps, under `_call`, the call as the model made it and the text it read back, so a thread
continued with previous_response_id shows the model its earlier tool results; `shown()` drops it from
everything a client sees. The same items sent back as `input` are read from what they show.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from chatloom.app.generation.tool_calls import ToolCall
from chatloom.app.tools.hosted import HostedTool, HostedTools, McpListing
from chatloom.app.tools.registry import ToolContext, ToolResult
from chatloom.store import new_id

ITEM_TYPES = {"web_search": "web_search_call", "file_search": "file_search_call",
              "code_interpreter": "code_interpreter_call", "mcp": "mcp_call"}
PREFIXES = {"web_search": "ws", "file_search": "fs", "code_interpreter": "ci", "mcp": "mcp"}
HIDDEN = "_call"


@dataclass
class HostedRun:
    """What a response needs to run its built-in tools between rounds."""

    tools: HostedTools
    turns: list[dict]  # the prompt's turns so far (tool_calls.render_messages' input)
    ctx: ToolContext
    include: set[str] = field(default_factory=set)
    max_calls: int = 4  # per response, as settings.chat.max_tool_calls_per_answer for an answer
    calls: int = 0


def shown(item: dict) -> dict:
    return {k: v for k, v in item.items() if k != HIDDEN} if HIDDEN in item else item


def listing_item(listing: McpListing) -> dict:
    tools = [{"name": t["name"], "description": t.get("description"), "input_schema": t.get("input_schema") or {},
              "annotations": None} for t in listing.tools]
    return {"type": "mcp_list_tools", "id": new_id("mcpl"), "server_label": listing.label, "tools": tools,
            "error": None}


def pending_item(tool: HostedTool, call: ToolCall, args: dict) -> dict:
    """The item as output_item.added shows it, before the tool runs."""
    kind, item_id = tool.kind, new_id(PREFIXES[tool.kind])
    item: dict = {"type": ITEM_TYPES[kind], "id": item_id, "status": "in_progress"}
    if kind == "web_search":
        item["action"] = {"type": "search", "query": str(args.get("query", ""))}
    elif kind == "file_search":
        item.update(queries=[str(args.get("query", ""))], results=None)
    elif kind == "code_interpreter":
        item.update(code="", container_id=None, outputs=None)
    else:
        item.update(server_label=tool.label, name=tool.remote_name, arguments=call.arguments, output=None,
                    error=None)
    return item


def before_events(tool: HostedTool, call: ToolCall, args: dict) -> list[tuple[str, dict]]:
    """Events between output_item.added and the tool's run."""
    kind = tool.kind
    if kind in ("web_search", "file_search"):
        return [(f"response.{ITEM_TYPES[kind]}.in_progress", {}), (f"response.{ITEM_TYPES[kind]}.searching", {})]
    if kind == "code_interpreter":
        code = str(args.get("code", ""))
        return [("response.code_interpreter_call.in_progress", {}),
                ("response.code_interpreter_call_code.delta", {"delta": code}),
                ("response.code_interpreter_call_code.done", {"code": code}),
                ("response.code_interpreter_call.interpreting", {})]
    return [("response.mcp_call.in_progress", {}), ("response.mcp_call_arguments.delta", {"delta": call.arguments}),
            ("response.mcp_call_arguments.done", {"arguments": call.arguments})]


def finished_item(pending: dict, tool: HostedTool, call: ToolCall, args: dict, result: ToolResult,
                  hosted: HostedRun) -> dict:
    """The item once the tool ran (a failure is the item's status or error; the model reads it either way)."""
    kind, details, include = tool.kind, result.details or {}, hosted.include
    failed = result.error is not None
    item = {**pending, "status": "failed" if failed else "completed"}
    if kind == "web_search" and "web_search_call.action.sources" in include:
        item["action"] = {**item["action"], "sources": [{"type": "url", "url": s["url"]}
                                                        for s in details.get("sources", [])]}
    elif kind == "file_search" and "file_search_call.results" in include:
        numbers = set(details.get("citations", []))
        item["results"] = [{"file_id": c["file_id"], "filename": c["filename"], "text": c["text"], "score": None,
                            "attributes": {"citation": c["n"], "page": c["page"]}}
                           for c in hosted.ctx.citations if c["n"] in numbers]
    elif kind == "code_interpreter":
        item.update(code=str(args.get("code", "")), container_id=hosted.ctx.conversation_id,
                    status="failed" if failed else "completed")
        if "code_interpreter_call.outputs" in include:
            logs = "".join(details.get(k) or "" for k in ("stdout", "stderr"))
            outputs: list[dict] = [{"type": "logs", "logs": logs}] if logs or not details else []
            if not details and failed:
                outputs = [{"type": "logs", "logs": result.error or ""}]
            outputs += [{"type": "image", "url": f"/v1/files/{f['id']}/content"}
                        for f in details.get("files", []) if f.get("image") and f.get("id")]
            item["outputs"] = outputs
    elif kind == "mcp":
        item.update(output=None if failed else result.output, error=result.error, status=item["status"])
    item[HIDDEN] = {"call_id": call.id, "name": call.name, "arguments": call.arguments, "output": result.model_text()}
    return item


def after_events(tool: HostedTool, item: dict) -> list[tuple[str, dict]]:
    kind = ITEM_TYPES[tool.kind]
    if tool.kind == "mcp" and item["status"] == "failed":
        return [("response.mcp_call.failed", {})]
    return [(f"response.{kind}.completed", {})]


class HostedItemIn(BaseModel):
    """A built-in call item sent back as input (a client that keeps the thread itself): kept as given."""

    model_config = ConfigDict(extra="allow")
    type: Literal["web_search_call", "file_search_call", "code_interpreter_call", "mcp_call", "mcp_list_tools"]
    id: str = Field(min_length=1, max_length=64)


def input_item(item: HostedItemIn) -> dict:
    return {k: v for k, v in item.model_dump().items() if k != HIDDEN}


def hosted_turns(item: dict, turns: list[dict]) -> bool:
    """Add a built-in call to a thread's turns (the call, then what the model read); False when the item is
    not one. A stored item keeps what the model read; one sent back as input is read from what it shows."""
    kind = item.get("type")
    if kind == "mcp_list_tools":
        return True  # the tools themselves are in the request's tools
    if kind not in ITEM_TYPES.values():
        return False
    hidden = item.get(HIDDEN)
    if isinstance(hidden, dict):
        call, output = ToolCall(hidden["call_id"], hidden["name"], hidden["arguments"]), hidden["output"]
    else:
        call, output = _shown_call(item)
    if turns and turns[-1]["role"] == "assistant":
        turns[-1].setdefault("tool_calls", []).append(call)
    else:
        turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
    turns.append({"role": "tool", "content": output})
    return True


def _shown_call(item: dict) -> tuple[ToolCall, str]:
    """A built-in call as the model would have made it, and its result as far as the item shows it."""
    kind, item_id = item["type"], item["id"]
    failed = f"error: {item.get('error') or 'the call failed'}" if item.get("status") == "failed" else None
    if kind == "web_search_call":
        action = item.get("action") if isinstance(item.get("action"), dict) else {}
        sources = [s.get("url") for s in action.get("sources") or [] if isinstance(s, dict)]
        output = "sources: " + ", ".join(map(str, sources)) if sources else "(the results are not kept)"
        return ToolCall(item_id, "web_search", json.dumps({"query": str(action.get("query", ""))})), failed or output
    if kind == "file_search_call":
        queries = item.get("queries") or [""]
        results = [r for r in item.get("results") or [] if isinstance(r, dict)]
        output = "\n\n".join(f"{r.get('filename')}:\n{r.get('text')}" for r in results) or "(the results are not kept)"
        return ToolCall(item_id, "file_search", json.dumps({"query": str(queries[0])})), failed or output
    if kind == "code_interpreter_call":
        logs = [str(o.get("logs")) for o in item.get("outputs") or [] if isinstance(o, dict) and o.get("logs")]
        output = "\n".join(logs) or "(the output is not kept)"
        return ToolCall(item_id, "python", json.dumps({"code": str(item.get("code") or "")})), failed or output
    name = f"{item.get('server_label')}__{item.get('name')}"
    output = f"error: {item['error']}" if item.get("error") else str(item.get("output") or "")
    return ToolCall(item_id, name, str(item.get("arguments") or "{}")), output
