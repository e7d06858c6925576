"""Export and import in Chromium: the JSON export the browser downloads, imported back by another account
through the settings panel, keeps both branches; ChatGPT's conversations.json imports with its tree; a
file that is not what it claims is refused with the reason and adds nothing."""
from __future__ import annotations

import json
from pathlib import Path

from browser_testing import sign_up, wait_js
from test_chat import send_and_wait, wait_idle

CHATGPT_EXPORT = Path(__file__).resolve().parent / "fixtures" / "chatgpt-conversations.json"


def users_shown(page) -> list[str]:
    return page.locator("#messages .message.user .bubble").all_inner_texts()


def import_file(page, files) -> None:
    page.click("#open-settings")
    page.wait_for_selector("#settings-dialog[open]")
    page.set_input_files("#import-file", files)


def open_conversation(page, title: str) -> None:
    page.locator(".conversation .open", has_text=title).click()
    wait_js(page, f"document.querySelector('#title')?.innerText === {json.dumps(title)}")


def test_export_json_and_markdown_then_import_back_with_every_branch(page, browser, server, tmp_path):
    sign_up(page)
    send_and_wait(page, "first question")
    send_and_wait(page, "second question")
    page.locator("#messages .message.user").first.locator(".edit").click()
    page.fill(".edit-input", "edited question")
    page.click(".edit-box .save")
    page.wait_for_selector(".message.streaming")
    wait_idle(page, 2)
    title = page.inner_text("#title")

    page.click("#open-settings")
    with page.expect_download() as download:
        page.click("#export-json")
    assert download.value.suggested_filename == "chatloom-conversations.json"
    exported = tmp_path / download.value.suggested_filename
    download.value.save_as(exported)
    [conversation] = json.loads(exported.read_text())["conversations"]
    assert len(conversation["messages"]) == 6  # both branches, though only one is on screen
    with page.expect_download() as markdown:
        page.click("#export-markdown")
    text = Path(markdown.value.path()).read_text()
    assert markdown.value.suggested_filename.endswith(".md") and f"# {title}" in text
    assert "edited question" in text and "second question" not in text  # the active branch only

    # Another person, in another browser, imports the downloaded file.
    context = browser.new_context(base_url=server.url)
    context.set_default_timeout(10_000)
    try:
        other = context.new_page()
        errors = []
        other.on("pageerror", lambda exc: errors.append(str(exc)))
        sign_up(other)
        import_file(other, str(exported))
        other.wait_for_selector("#import-status:has-text('Imported 1 conversation (6 messages).')")
        other.click("#settings-close")
        wait_js(other, "document.querySelectorAll('.conversation').length === 1")
        open_conversation(other, title)
        other.wait_for_selector("#messages .message.user .position")
        assert users_shown(other) == ["edited question"]
        assert other.locator("#messages .message.user .position").inner_text() == "2/2"
        other.locator("#messages .message.user .prev").click()
        wait_js(other, "document.querySelectorAll('#messages .message').length === 4")
        assert users_shown(other) == ["first question", "second question"]
        answers = other.locator("#messages .message.assistant .bubble").all_inner_texts()
        assert [a.strip() for a in answers] == [m["text"].strip() for m in conversation["messages"]
                                                if m["role"] == "assistant"][:2]
        assert errors == []
    finally:
        context.close()


def test_import_a_chatgpt_export_and_refuse_a_file_that_is_not_one(page):
    sign_up(page)
    import_file(page, str(CHATGPT_EXPORT))
    page.wait_for_selector("#import-status:has-text('Imported 2 conversations (6 messages).')")
    page.click("#settings-close")
    wait_js(page, "document.querySelectorAll('.conversation').length === 2")

    open_conversation(page, "Arithmetic")
    page.wait_for_selector("#messages .message.assistant")
    # ChatGPT's current node is the edited question's branch; the system root and tool node are left out.
    assert users_shown(page) == ["What is 3+3?"]
    assert page.inner_text("#messages .message.assistant .bubble").strip() == "3+3 is 6."
    assert page.locator("#messages .message.user .position").inner_text() == "2/2"
    page.locator("#messages .message.user .prev").click()
    wait_js(page, "document.querySelector('#messages .message.user .bubble')?.innerText === 'What is 2+2?'")
    assert page.inner_text("#messages .message.assistant .bubble").strip() == "2+2 is 4."
    open_conversation(page, "Weekend in Porto")
    page.wait_for_selector("#messages .message.assistant >> text=Dom Luis bridge")

    # A PDF named conversations.json: refused with the reason, nothing added.
    import_file(page, {"name": "conversations.json", "mimeType": "application/json",
                       "buffer": b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n%%EOF\n"})
    page.wait_for_selector("#settings-error:not([hidden])")
    assert "not JSON" in page.inner_text("#settings-error")
    assert page.inner_text("#import-status") == ""
    page.click("#settings-close")
    page.reload()
    wait_js(page, "document.querySelectorAll('.conversation').length === 2")
    assert page.console_errors == []
