"""Web search and page reading for the chat's model: `web_search` asks a search provider (SearXNG's
JSON API, behind the `SearchProvider` interface) and `fetch_page` reads one page as plain text.

Both go through the safe fetcher (app/core/safe_fetch.py): the model chooses the URLs, so private,
loopback and link-local addresses are refused unless settings.tools.fetch_allow names them. The
SearXNG URL itself is the administrator's choice and is reached even on a private address. Results
reach the model numbered, with their URLs, and it is asked to cite the ones it uses.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlencode, urlsplit

import lxml.html
from lxml.etree import ParserError
from readability import Document

from chatloom.app.core.safe_fetch import FetchPolicy, FetchRefused, display_url, safe_fetch
from chatloom.app.generation.tool_calls import ToolSpec
from chatloom.app.tools.registry import Tool, ToolContext, ToolFailure, ToolOutput
from chatloom.settings.tree import ToolsSettings

CITE = "Cite the sources you use by their URLs."
_HTML = ("text/html", "application/xhtml+xml")
_TEXT = ("text/plain", "text/markdown")


@dataclass(frozen=True)
class SearchHit:
    title: str
    url: str
    snippet: str


class SearchProvider(Protocol):
    async def search(self, query: str, count: int) -> list[SearchHit]:
        """The best `count` results for a query; FetchRefused or ToolFailure when the provider fails."""


class SearxngSearch:
    """A SearXNG instance's JSON API (`format=json` must be enabled in its settings.yml)."""

    def __init__(self, base_url: str, policy: FetchPolicy) -> None:
        self.base_url = base_url.rstrip("/")
        host = urlsplit(self.base_url).hostname or ""
        self.policy = FetchPolicy(allow=(*policy.allow, host), max_bytes=policy.max_bytes,
                                  timeout_s=policy.timeout_s, max_redirects=policy.max_redirects)

    async def search(self, query: str, count: int) -> list[SearchHit]:
        url = f"{self.base_url}/search?{urlencode({'q': query, 'format': 'json', 'safesearch': 1})}"
        reply = await safe_fetch(url, self.policy, headers={"Accept": "application/json"})
        if reply.status != 200:
            raise ToolFailure(f"the search service answered HTTP {reply.status}")
        try:
            results = json.loads(reply.body)["results"]
            hits = [SearchHit(str(r.get("title") or r["url"]), str(r["url"]), str(r.get("content") or ""))
                    for r in results if isinstance(r, dict) and isinstance(r.get("url"), str)]
        except (ValueError, KeyError, TypeError):
            raise ToolFailure("the search service's answer is not SearXNG JSON") from None
        return hits[:count]


def readable_text(html: str) -> tuple[str, str]:
    """A page's title and the text of its main content (readability's choice), blank lines squeezed."""
    try:
        doc = Document(html)
        title = doc.short_title() or ""
        content = lxml.html.fromstring(doc.summary(html_partial=True)).text_content()
    except (ParserError, ValueError, TypeError):
        raise ToolFailure("the page could not be read as HTML") from None
    lines = [" ".join(line.split()) for line in content.splitlines()]
    return title.strip(), "\n".join(line for line in lines if line)


class WebTools:
    """The two tools over one fetch policy and (for search) one provider."""

    def __init__(self, settings: ToolsSettings, provider: SearchProvider | None = None) -> None:
        self.policy = FetchPolicy(allow=tuple(settings.fetch_allow), max_bytes=settings.fetch_max_bytes,
                                  timeout_s=settings.fetch_timeout_s, max_redirects=settings.fetch_max_redirects)
        self.provider = provider or (SearxngSearch(settings.search_url, self.policy) if settings.search_url else None)
        self.results = settings.search_results
        self.text_chars = settings.fetch_text_chars
        self.timeout_s = settings.fetch_timeout_s + 5  # the fetch's own limit answers first, in words

    def search_tool(self) -> Tool:
        spec = ToolSpec("web_search", "Search the web. Returns numbered results with their URLs and snippets.",
                        {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"],
                         "additionalProperties": False})
        return Tool(spec, self._search, timeout_s=self.timeout_s)

    def fetch_tool(self) -> Tool:
        spec = ToolSpec("fetch_page", "Read a web page (http or https URL) as plain text.",
                        {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"],
                         "additionalProperties": False})
        return Tool(spec, self._fetch, timeout_s=self.timeout_s, max_output_chars=self.text_chars + 1000)

    async def _search(self, args: dict, ctx: ToolContext) -> ToolOutput:
        query = " ".join(args["query"].split())[:400]
        if not query:
            raise ToolFailure("the query is empty")
        if self.provider is None:
            raise ToolFailure("web search is not configured on this server")
        try:
            hits = await self.provider.search(query, self.results)
        except FetchRefused as exc:
            raise ToolFailure(f"the search failed: {exc}") from None
        details = {"query": query, "sources": [{"title": h.title[:150], "url": h.url} for h in hits]}
        if not hits:
            return ToolOutput(f"no results for {query!r}", details)
        lines = [f"[{n}] {h.title[:150]}\n{h.url}\n{' '.join(h.snippet.split())[:300]}" for n, h in enumerate(hits, 1)]
        return ToolOutput("\n\n".join(lines) + f"\n\n{CITE}", details)

    async def _fetch(self, args: dict, ctx: ToolContext) -> str:
        try:
            page = await safe_fetch(args["url"].strip(), self.policy, truncate=True,
                                    headers={"Accept": "text/html, text/plain;q=0.9"})
        except FetchRefused as exc:
            raise ToolFailure(str(exc)) from None
        if page.status >= 400:
            raise ToolFailure(f"{display_url(page.url)} answered HTTP {page.status}")
        kind = page.content_type.split(";")[0].strip().lower()
        if kind in _HTML:
            title, text = await asyncio.to_thread(readable_text, page.text())
        elif kind in _TEXT or not kind:
            title, text = "", page.text()
        else:
            raise ToolFailure(f"{display_url(page.url)} is {kind}, not a web page")
        cut = len(text) > self.text_chars
        head = f"Title: {title}\n" if title else ""
        return (f"{head}URL: {display_url(page.url)}\n\n{text[:self.text_chars]}"
                + ("\n[cut]" if cut else "") + f"\n\n{CITE}")
