"""Browser tests: Playwright drives Debian's Chromium (/usr/bin/chromium) against a live uvicorn
on 127.0.0.1 serving the app with a scripted backend (deterministic answers, streamed word by word).

Without Chromium or the playwright package the tests skip with the reason; CI installs both
(.ci/run installs chromium with apt-get; playwright is pinned in requirements-dev.txt).
Screenshots of the main screens go to artifacts/screenshots/.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "app"))

from app_testing import LiveServer, make_settings  # noqa: E402
from browser_testing import CHROMIUM, CHROMIUM_ARGS, DESKTOP, PHONE  # noqa: E402

from chatloom.app.main import create_app  # noqa: E402
from scripted_backend import ScriptedBackend  # noqa: E402

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    sync_playwright = None


def _skip_reason() -> str | None:
    if sync_playwright is None:
        return "the playwright package is not installed (pip install -r requirements-dev.txt)"
    if not Path(CHROMIUM).exists():
        return f"Chromium not found at {CHROMIUM} (apt-get install chromium; .ci/run does this in CI)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _skip_reason()
    if reason:
        here = Path(__file__).resolve().parent
        for item in items:
            if here in Path(str(item.fspath)).resolve().parents:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("e2e"), sampling={"max_tokens": 1000})
    with LiveServer(create_app(settings, ScriptedBackend())) as live:
        yield live


@pytest.fixture(scope="module")
def browser():
    # Module scope: while sync Playwright is open its event loop counts as running in this thread,
    # which would break asyncio.run() and async tests in the modules that run after these.
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


def _new_page(browser, server, viewport):
    context = browser.new_context(viewport=viewport, base_url=server.url)
    context.set_default_timeout(10_000)
    page = context.new_page()
    page.dialogs = []  # any alert() would land here (and be dismissed)
    page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))
    page.console_errors = []
    page.on("pageerror", lambda exc: page.console_errors.append(str(exc)))
    return context, page


@pytest.fixture
def page(browser, server):
    context, page = _new_page(browser, server, DESKTOP)
    yield page
    context.close()


@pytest.fixture
def phone_page(browser, server):
    context, page = _new_page(browser, server, PHONE)
    yield page
    context.close()


