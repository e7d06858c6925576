"""Admission in the browser: with one generation slot, a second user's answer waits in the queue
(its position shown), and a wait past the limit ends as a plain 'busy' notice with a retry countdown."""
from __future__ import annotations

import re

import pytest

from app_testing import LiveServer, make_settings
from browser_testing import DESKTOP, screenshot, sign_up, wait_js
from chatloom.app.main import create_app
from scripted_backend import ScriptedBackend


@pytest.fixture(scope="module")
def one_slot_server(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("e2e-queue"), sampling={"max_tokens": 1000}, traffic={"admission_max_running": 1, "queue_max_wait_s": 2.0})
    with LiveServer(create_app(settings, ScriptedBackend())) as live:
        yield live


def test_queue_position_then_busy_notice(browser, one_slot_server):
    first = browser.new_context(viewport=DESKTOP, base_url=one_slot_server.url)
    second = browser.new_context(viewport=DESKTOP, base_url=one_slot_server.url)
    try:
        a, b = first.new_page(), second.new_page()
        sign_up(a)
        sign_up(b)
        a.fill("#input", "a long answer to hold the only slot")
        a.press("#input", "Enter")
        wait_js(a, "document.querySelector('.message.streaming .bubble')?.innerText.length > 10")

        b.fill("#input", "my turn?")
        b.press("#input", "Enter")
        queue = b.locator(".message.streaming .queue")
        queue.wait_for()
        assert queue.inner_text() == "Waiting in queue: position 1"
        screenshot(b, "desktop-queued")
        # Past queue_max_wait_s the answer fails as 503: a notice with a countdown, not broken output.
        wait_js(b, "document.body.dataset.answers === '1'")
        notice = b.locator("#notice-text").inner_text()
        assert re.match(r"The server is busy: .+ Try again in \d+ s\.$", notice), notice
        assert b.locator("#notice-retry").is_visible()
        assert b.locator(".message.assistant").last.get_attribute("data-status") == "error"
        a.click("#stop")
        wait_js(a, "document.body.dataset.answers === '1'")
    finally:
        first.close()
        second.close()
