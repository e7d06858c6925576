"""The Files panel in Chromium: list, delete, attach and detach one's files; make a collection, fill
it, attach it to a new chat whose answer then cites it, and detach it again."""
from __future__ import annotations

from browser_testing import sign_up, wait_js
from test_chat import send_and_wait
from test_files_browser import NOTES

QUESTION = "Where is the spare key to the greenhouse?"


def api_get(page, path: str) -> dict:
    """GET an API path as the signed-in user of the page: {"status", "body"}."""
    return page.evaluate("""async (path) => {
        const token = localStorage.getItem('chatloom.token');
        const res = await fetch(path, { headers: { Authorization: `Bearer ${token}` } });
        return { status: res.status, body: res.ok ? await res.json() : null };
    }""", path)


def conversation_id(page) -> str:
    return wait_js(page, "new URLSearchParams(location.hash.slice(1)).get('c')")


def panel_draws(page) -> int:
    return page.evaluate("Number(document.getElementById('library').dataset.loaded || 0)")


def redrawn(page, action) -> None:
    """Do `action` in the panel and wait until the panel has been drawn again after it."""
    before = panel_draws(page)
    action()
    wait_js(page, f"Number(document.getElementById('library').dataset.loaded || 0) > {before}")


def open_panel(page) -> None:
    redrawn(page, lambda: page.click("#open-library"))
    page.wait_for_selector("#library[open]")


def listed(page) -> list[str]:
    return page.locator("#file-list .library-file .name").all_inner_texts()


def file_row(page, name: str):
    return page.locator("#file-list .library-file", has_text=name)


def test_list_delete_attach_and_detach_files(page, tmp_path):
    sign_up(page)
    first, second = tmp_path / "agenda.md", tmp_path / "budget.txt"
    first.write_text("# Agenda\n\nThe board meets on Thursday.\n")
    second.write_text("The budget for the picnic is forty euros.\n")
    page.set_input_files("#file-input", [str(first), str(second)])
    page.wait_for_selector("#attachments .chip:not(.uploading) >> text=agenda.md")
    page.wait_for_selector("#attachments .chip:not(.uploading) >> text=budget.txt")
    conv = conversation_id(page)

    open_panel(page)
    assert sorted(listed(page)) == ["agenda.md", "budget.txt"]
    assert file_row(page, "agenda.md").locator("button.detach").count() == 1  # it is on the open chat
    agenda_id = file_row(page, "agenda.md").get_attribute("data-id")

    # Delete asks first; No keeps the file, Yes removes it from the list, the chat and the API.
    file_row(page, "agenda.md").locator("button.delete").click()
    file_row(page, "agenda.md").locator("button.no").click()
    assert file_row(page, "agenda.md").locator("button.delete").count() == 1
    file_row(page, "agenda.md").locator("button.delete").click()
    redrawn(page, lambda: file_row(page, "agenda.md").locator("button.yes").click())
    assert listed(page) == ["budget.txt"]
    assert api_get(page, f"/files/{agenda_id}")["status"] == 404
    wait_js(page, "document.querySelectorAll('#attachments .chip').length === 1")
    assert "budget.txt" in page.inner_text("#attachments .chip")

    # Detached with the panel's button: the file stays in the account, off the chat.
    redrawn(page, lambda: file_row(page, "budget.txt").locator("button.detach").click())
    assert file_row(page, "budget.txt").locator("button.attach").count() == 1
    wait_js(page, "document.getElementById('attachments').hidden")
    # Attached again from the panel, then detached with the chip's ×.
    redrawn(page, lambda: file_row(page, "budget.txt").locator("button.attach").click())
    page.wait_for_selector("#attachments .chip >> text=budget.txt")
    page.click("#library-close")
    page.click("#attachments .chip:has-text('budget.txt') button[aria-label='Detach budget.txt from this chat']")
    wait_js(page, "document.getElementById('attachments').hidden")
    attached = api_get(page, f"/conversations/{conv}/files")["body"]
    assert attached == {"files": [], "collections": []}
    assert [f["filename"] for f in api_get(page, "/files")["body"]] == ["budget.txt"]
    assert page.console_errors == [] and page.dialogs == []


def test_a_collection_attached_to_a_new_chat_is_read_and_cited(page, tmp_path):
    sign_up(page)
    notes = tmp_path / "notes.md"
    notes.write_text(NOTES)
    open_panel(page)
    redrawn(page, lambda: page.set_input_files("#library-input", str(notes)))  # the panel's Upload…
    assert listed(page) == ["notes.md"]
    assert page.locator(".conversation").count() == 0  # an upload from the panel makes no chat

    page.fill("#collection-name", "Garden")
    redrawn(page, lambda: page.press("#collection-name", "Enter"))
    collection = page.locator("#collection-list .library-collection", has_text="Garden")
    assert collection.locator(".members").inner_text() == "No files yet"
    # A second collection of the same name: the API's refusal shows in the notice bar.
    page.fill("#collection-name", "Garden")
    redrawn(page, lambda: page.press("#collection-name", "Enter"))
    assert page.inner_text("#notice-text") == ("Could not create the collection Garden: "
                                               "you already have a collection named 'Garden'.")
    assert page.locator("#collection-list .library-collection").count() == 1

    collection.locator("select.add-file").select_option(label="notes.md")
    redrawn(page, lambda: collection.get_by_role("button", name="Add file").click())
    assert collection.locator(".members").inner_text() == "1 file: notes.md"
    assert collection.locator("select.add-file").count() == 0  # nothing left to add

    # Attached to the new chat (made for it), by keyboard.
    collection.get_by_role("button", name="Attach Garden to this chat").focus()
    redrawn(page, lambda: page.keyboard.press("Enter"))
    page.wait_for_selector("#attachments .chip.collection >> text=Garden")
    assert collection.locator("button.detach").count() == 1
    conv = conversation_id(page)
    page.keyboard.press("Escape")
    page.wait_for_selector("#library", state="hidden")

    send_and_wait(page, QUESTION)
    sources = page.locator("#messages .message.assistant").last.locator(".source")
    assert sources.first.inner_text().startswith("[1] notes.md")

    page.click("#attachments .chip.collection button.chip-remove")
    wait_js(page, "document.getElementById('attachments').hidden")
    assert api_get(page, f"/conversations/{conv}/files")["body"]["collections"] == []
    send_and_wait(page, QUESTION)
    assert page.locator("#messages .message.assistant").last.locator(".source").count() == 0  # no longer read
    assert page.console_errors == [] and page.dialogs == []
