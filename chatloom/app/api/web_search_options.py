"""Chat Completions' `web_search_options`: as OpenAI's search models do, the server searches the web for
the user's last message before the model answers (the `web_search` built-in, tools/hosted.py, through
the chat's tool registry), puts the numbered results with their URLs in the system message, and the
whole answer's message carries a `url_citation` annotation for each result URL it quotes.

`search_context_size` and `user_location` are accepted and not used. The other built-in tool types
(file_search, code_interpreter, mcp) exist on the Responses API only.
"""
from __future__ import annotations

import json
from typing import Any

from chatloom.app.core.errors import ApiError
from chatloom.app.generation.pipeline import ChatPrompt
from chatloom.app.generation.tool_calls import ToolCall
from chatloom.app.tools.hosted import HostedToolbox
from chatloom.app.tools.registry import ToolContext, ToolRegistry
from chatloom.settings import Settings
from chatloom.store import Database, User
from chatloom.store.blobs import BlobStore

HEADER = "Web search results for the user's last message follow; use them and cite the URLs you rely on."
MAX_QUERY_CHARS = 400


async def searched(toolbox: HostedToolbox | None, options: dict[str, Any], prompt: ChatPrompt, user: User,
                   db: Database, blobs: BlobStore | None, settings: Settings) -> tuple[ChatPrompt, list[dict]]:
    """The prompt with the search results in its system message, and the results' sources (title, url);
    400 where web search is off or not configured."""
    if toolbox is None:
        raise ApiError(400, "web search is not available on this server", "unsupported_value", "web_search_options")
    tool = toolbox.web_search("web_search_options").tool
    question = next((m["content"] for m in reversed(prompt.messages) if m["role"] == "user"), "")
    query = " ".join(str(question).split())[:MAX_QUERY_CHARS]
    if not query:
        raise ApiError(400, "web_search_options needs a user message to search for", "invalid_value", "messages")
    call = ToolCall("web_search_options", tool.spec.name, json.dumps({"query": query}))
    result = await ToolRegistry([tool]).run(call, ToolContext(user, db, "", blobs, settings))
    context = f"{HEADER}\n\n{result.model_text()}"
    messages = list(prompt.messages)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{context}"}
    else:
        messages.insert(0, {"role": "system", "content": context})
    sources = (result.details or {}).get("sources", []) if result.error is None else []
    return ChatPrompt(messages, continue_final=prompt.continue_final), sources


def url_citations(text: str, sources: list[dict]) -> list[dict]:
    """A url_citation annotation for each place the answer quotes a result's URL."""
    out = []
    for source in sources:
        url, start = source["url"], 0
        while (at := text.find(url, start)) >= 0:
            out.append({"type": "url_citation", "url_citation": {"start_index": at, "end_index": at + len(url),
                                                                  "title": source.get("title") or url, "url": url}})
            start = at + len(url)
    return sorted(out, key=lambda a: a["url_citation"]["start_index"])
