"""web_search over a fake SearXNG and fetch_page over a page on loopback (both allow-listed), in a
chat answer: the results reach the model with their URLs and the answer cites them; the fetcher's
refusals and a broken search service come back as tool errors."""
from __future__ import annotations

import json

import pytest

from chatloom.app.generation.tool_calls import ToolCall
from chatloom.app.tools.builtins import builtin_registry
from chatloom.app.tools.web import readable_text
from chatloom.settings import Settings

from app_testing import (ToolCallingBackend, app_client, call_text, done_of, make_settings, new_conversation,
                         send, tokens_of)
from fake_web import ARTICLE, fake_web


@pytest.fixture
def web():
    with fake_web() as w:
        yield w


def _result(events) -> dict:
    return next(e.data["tool_result"] for e in events if isinstance(e.data, dict) and "tool_result" in e.data)


async def test_search_then_read_a_page_and_cite_it(tmp_path, web):
    settings = make_settings(tmp_path, chat={"tools": "web_search,fetch_page"}, sampling={"max_tokens": 2000},
                             tools={"search_url": web.base, "fetch_allow": ["127.0.0.1"]})
    async with app_client(settings, ToolCallingBackend()) as (client, app, alice):
        cid = await new_conversation(client, alice)
        _, events = await send(client, alice, cid, call_text("web_search", query="danube otters"))
        result = _result(events)
        assert result["error"] is None and web.searches == ["danube otters"]
        assert result["output"].startswith(f"[1] Otters of the Danube\n{web.base}/article\nSurveys in 2025")
        assert f"[2] Otter notes\n{web.base}/notes.txt" in result["output"]
        assert f"{web.base}/article" in tokens_of(events)  # the answer cites the URL
        _, events = await send(client, alice, cid, call_text("fetch_page", url=f"{web.base}/article"))
        page = _result(events)["output"]
        assert page.startswith(f"Title: Otters of the Danube\nURL: {web.base}/article\n\n")
        assert "412 animals" in page and "healthy river" in page
        assert "otter mugs" not in page and "Copyright" not in page  # the page's chrome is left out
        assert f"URL: {web.base}/article" in tokens_of(events) and done_of(events)["status"] == "complete"


async def test_the_fetcher_refuses_loopback_unless_allow_listed(tmp_path, web):
    settings = make_settings(tmp_path, chat={"tools": "fetch_page"}, sampling={"max_tokens": 2000})
    async with app_client(settings, ToolCallingBackend()) as (client, app, alice):
        cid = await new_conversation(client, alice)
        for url in (f"{web.base}/article", f"http://[::1]:{web.port}/article", "http://169.254.169.254/latest"):
            _, events = await send(client, alice, cid, call_text("fetch_page", url=url))
            assert "private, loopback or link-local" in _result(events)["error"]
            assert done_of(events)["status"] == "complete"  # the model read the error and answered
        assert web.hosts == []


async def test_failures_are_tool_errors(web):
    settings = Settings(tools={"search_url": f"{web.base}/garbage", "fetch_allow": ["127.0.0.1"],
                               "fetch_timeout_s": 1.0, "fetch_text_chars": 300})
    registry = builtin_registry(["web_search", "fetch_page"], settings)

    async def run(name: str, **args: str):
        return await registry.run(ToolCall("c", name, json.dumps(args)), None)

    assert (await run("web_search", query="x")).error == "the search service's answer is not SearXNG JSON"
    assert (await run("fetch_page", url=f"{web.base}/image.png")).error.endswith("is image/png, not a web page")
    assert (await run("fetch_page", url=f"{web.base}/missing")).error.endswith("answered HTTP 404")
    assert "longer than 1 s" in (await run("fetch_page", url=f"{web.base}/slow")).error
    assert (await run("fetch_page", url="file:///etc/passwd")).error.startswith("only http and https")
    long = await run("fetch_page", url=f"{web.base}/large")  # cut to the text the model may read
    assert long.error is None and "[cut]" in long.output and len(long.output) < 500
    down = builtin_registry(["web_search"], Settings(tools={"search_url": "http://127.0.0.1:9",
                                                             "fetch_allow": []}))
    assert (await down.run(ToolCall("c", "web_search", '{"query": "x"}'), None)).error.startswith("the search failed")
    assert builtin_registry(["web_search"], Settings()).tools == {}  # no search_url: not offered


def test_readable_text_keeps_the_article():
    title, text = readable_text(ARTICLE)
    assert title == "Otters of the Danube"
    assert text.startswith("Otters of the Danube\nEurasian otters") or text.startswith("Eurasian otters")
