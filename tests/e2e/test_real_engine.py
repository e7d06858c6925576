"""The browser app on the real serving path: the chatloom engine running the tiny random model
(its text is random tokens, so this checks the plumbing, not the words)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from app_testing import LiveServer, make_settings
from chatloom.app.main import create_app
from chatloom.engine import EngineConfig
from chatloom.serving import LocalBackend
from browser_testing import CHROMIUM_ARGS, DESKTOP, sign_up, wait_js


def run_aside(coro) -> None:
    """asyncio.run in another thread: Playwright's sync API keeps an event loop running in this one."""
    errors = []
    thread = threading.Thread(target=lambda: _run(coro, errors))
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _run(coro, errors) -> None:
    try:
        asyncio.run(coro)
    except Exception as exc:  # pragma: no cover - reported by the caller
        errors.append(exc)


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory, tiny_model_fp32):
    backend = LocalBackend(tiny_model_fp32, engine_config=EngineConfig(num_blocks=256, max_num_seqs=4))
    run_aside(backend.start())
    settings = make_settings(tmp_path_factory.mktemp("e2e-engine"), sampling={"max_tokens": 120})
    try:
        with LiveServer(create_app(settings, backend)) as live:
            yield live
    finally:
        run_aside(backend.close())


def test_tiny_model_answer_streams_into_the_page(browser, engine_server):
    context = browser.new_context(viewport=DESKTOP, base_url=engine_server.url)
    try:
        page = context.new_page()
        dialogs = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        sign_up(page)
        assert page.locator("#model option").first.inner_text() == "tiny-random"
        # The tiny model can finish its answer within milliseconds, before a selector poll would see
        # the streaming state: an observer records it as it happens.
        page.evaluate("""() => {
            window.sawStreaming = false;
            new MutationObserver(() => {
                if (document.querySelector('.message.streaming')) window.sawStreaming = true;
            }).observe(document.body, {subtree: true, childList: true, attributes: true});
        }""")
        page.fill("#input", "Hello, engine")
        page.press("#input", "Enter")
        wait_js(page, "document.body.dataset.answers === '1'", timeout_s=60)
        assert page.evaluate("window.sawStreaming")
        answer = page.locator("#messages .message.assistant").last
        assert answer.get_attribute("data-status") in ("complete", "incomplete")
        assert answer.locator(".bubble").inner_text().strip()
        assert page.locator("[onerror], [onload]").count() == 0 and dialogs == []
    finally:
        context.close()
