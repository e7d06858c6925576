"""The account's places in Chromium: share a conversation and open the link in a fresh browser context
without logging in; the settings panel keeps instructions and memories; export and import back."""
from __future__ import annotations

from browser_testing import sign_up, wait_js

from test_chat import send_and_wait


def test_share_a_conversation_and_open_the_link_signed_out(page, browser, server):
    page.goto("/")
    page.wait_for_selector("#auth:not([hidden])")
    sign_up(page)
    send_and_wait(page, "A question worth sharing")
    answer = page.locator("#messages .message.assistant .bubble").last.inner_text()
    page.click("#share")
    page.wait_for_selector("#share-dialog[open]")
    url = page.input_value("#share-url")
    assert "/s/" in url
    page.click("#share-close")
    send_and_wait(page, "A later question, not shared")

    fresh = browser.new_context(base_url=server.url)  # no token, no cookie: a stranger's browser
    try:
        other = fresh.new_page()
        other.goto(url)
        other.wait_for_selector("#shared-messages .message.assistant")
        texts = other.locator("#shared-messages .message").all_inner_texts()
        assert texts[0].strip() == "A question worth sharing" and texts[1].strip() == answer.strip()
        assert len(texts) == 2 and "not shared" not in other.content()

        # Revoked in the owner's settings: the link stops working.
        page.click("#open-settings")
        page.wait_for_selector("#link-list .shared-link")
        page.click("#link-list .shared-link button")
        wait_js(page, "!document.querySelector('#link-list .shared-link')")
        other.reload()
        other.wait_for_selector("#shared-error:not([hidden])")
        assert "revoked" in other.inner_text("#shared-error")
    finally:
        fresh.close()


def test_share_up_to_an_earlier_answer(page, browser, server):
    sign_up(page)
    send_and_wait(page, "The first question")
    send_and_wait(page, "The second question, kept private")
    first = page.locator("#messages .message.assistant").first
    answer = first.locator(".bubble").inner_text()
    first.get_by_role("button", name="Share up to here").click()
    page.wait_for_selector("#share-dialog[open]")
    assert page.inner_text("#share-scope") == "up to the chosen message (2 messages)"
    url = page.input_value("#share-url")
    page.click("#share-close")

    fresh = browser.new_context(base_url=server.url)  # signed out
    try:
        other = fresh.new_page()
        other.goto(url)
        other.wait_for_selector("#shared-messages .message.assistant")
        texts = other.locator("#shared-messages .message").all_inner_texts()
        assert [t.strip() for t in texts] == ["The first question", answer.strip()]
        assert "kept private" not in other.content()
    finally:
        fresh.close()

    page.click("#share")  # the top bar's Share still shares the whole branch
    page.wait_for_selector("#share-dialog[open]")
    assert page.inner_text("#share-scope") == "as it is now"


def test_settings_keep_instructions_and_memories(page):
    page.goto("/")
    page.wait_for_selector("#auth:not([hidden])")
    sign_up(page)
    page.click("#open-settings")
    page.fill("#instructions", "Answer like a pirate.")
    page.click("#instructions-save")
    page.wait_for_selector("#instructions-save:text('Saved')")
    page.fill("#memory-new", "I live in Lisbon.")
    page.press("#memory-new", "Enter")
    page.wait_for_selector("#memory-list .memory")
    assert page.input_value("#memory-list .memory-text") == "I live in Lisbon."
    page.click("#settings-close")
    page.reload()
    page.click("#open-settings")
    page.wait_for_selector("#memory-list .memory")
    assert page.input_value("#instructions") == "Answer like a pirate."
    page.click("#memory-list .memory button.danger")
    wait_js(page, "!document.querySelector('#memory-list .memory')")
