"""The sidebar's search box in Chromium: a word in an old conversation's third message finds it, the
match is highlighted, a click opens it, and markup in a message stays text."""
from __future__ import annotations

from browser_testing import sign_up, wait_js
from test_chat import send_and_wait


def test_search_finds_an_old_conversation_by_a_word_in_its_third_message(page):
    sign_up(page)
    send_and_wait(page, "planning the garden")
    send_and_wait(page, "we also need <img src=x onerror=alert(1)> rhubarbstalks and compost")  # the third message
    page.click("#new-chat")
    send_and_wait(page, "something else entirely")
    assert page.locator(".conversation").count() == 2

    page.fill("#search", "rhubarbstalk")  # a prefix of the word, as one types
    wait_js(page, "document.querySelectorAll('.conversation .snippet').length === 1")
    hit = page.locator(".conversation")
    assert hit.count() == 1 and hit.locator(".title").inner_text() == "planning the garden"
    assert hit.locator("mark").inner_text() == "rhubarbstalks"
    assert "<img" in hit.locator(".snippet").inner_text()  # shown as text
    assert page.locator(".conversation img").count() == 0 and page.dialogs == []

    hit.locator(".open").click()
    page.wait_for_selector("#messages .message.user >> text=rhubarbstalks")
    assert page.locator("#title").inner_text() == "planning the garden"

    page.fill("#search", "nothingmatchesthis")
    wait_js(page, "document.querySelector('#conversation-list p')?.innerText === 'No conversation matches.'")
    page.fill("#search", "")
    wait_js(page, "document.querySelectorAll('.conversation').length === 2")
    assert page.console_errors == []
