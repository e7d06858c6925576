"""Files in the browser (Chromium): attach a PDF with the button, drop a Markdown file on the page and
paste one into the input, ask a question only they answer, and open the citation on the right passage."""
from __future__ import annotations

import sys
from pathlib import Path

from browser_testing import sign_up, wait_js
from test_chat import send_and_wait

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "app" / "files"))
from file_samples import PNG, make_pdf  # noqa: E402

NOTES = ("# Site notes\n\nThe spare key to the greenhouse is hidden under the blue flowerpot by the gate.\n\n"
         + "Unrelated paragraph about the weather. " * 40 + "\n")


def drop_file(page, name: str, data: bytes, mime: str) -> None:
    """Drop a file on the page as a user dragging it from the desktop would."""
    page.evaluate("""([name, bytes, mime]) => {
        const dt = new DataTransfer();
        dt.items.add(new File([new Uint8Array(bytes)], name, { type: mime }));
        const app = document.getElementById('app');
        app.dispatchEvent(new DragEvent('dragover', { dataTransfer: dt, bubbles: true, cancelable: true }));
        app.dispatchEvent(new DragEvent('drop', { dataTransfer: dt, bubbles: true, cancelable: true }));
    }""", [name, list(data), mime])


def test_upload_ask_and_open_the_cited_passage(page, tmp_path):
    sign_up(page)
    pdf = tmp_path / "inventory.pdf"
    pdf.write_bytes(make_pdf(["Warehouse inventory for spring.", "The forklift battery charger is in bay twelve."]))
    page.set_input_files("#file-input", str(pdf))  # the attach button's file picker
    page.wait_for_selector("#attachments .chip:not(.uploading) >> text=inventory.pdf")
    drop_file(page, "notes.md", NOTES.encode(), "text/markdown")
    page.wait_for_selector("#attachments .chip:not(.uploading) >> text=notes.md")
    assert page.locator(".conversation").count() == 1  # the upload made the conversation

    send_and_wait(page, "Where is the spare key to the greenhouse?")
    sources = page.locator("#messages .message.assistant .sources .source")
    assert sources.count() >= 1
    first = sources.first
    assert first.inner_text().startswith("[1] notes.md")
    first.click()
    page.wait_for_selector("#passage[open]")
    mark = page.locator("#passage-text mark")
    wait_js(page, "document.querySelector('#passage-text').innerText.includes('Site notes')")  # the whole document
    assert "blue flowerpot" in mark.inner_text()
    page.click("#passage-close")

    send_and_wait(page, "Which bay holds the forklift battery charger?")
    answer = page.locator("#messages .message.assistant").last
    cited = answer.locator(".source").all_inner_texts()
    assert cited[0].startswith("[1] inventory.pdf, p. 1"), cited  # the page the passage begins on
    answer.locator(".source").first.click()
    page.wait_for_selector("#passage[open]")
    assert "bay twelve" in page.locator("#passage-text mark").inner_text()
    page.click("#passage-close")

    # A file the server does not read: a notice names the problem, and nothing is attached.
    drop_file(page, "photo.txt", PNG, "text/plain")
    page.wait_for_selector("#notice:not([hidden])")
    assert "PNG" in page.locator("#notice-text").inner_text()
    assert page.locator("#attachments .chip").count() == 2
    assert page.console_errors == [] and page.dialogs == []


def test_a_file_pasted_into_the_input_is_uploaded_and_answers_from_it(page):
    sign_up(page)
    page.evaluate("""(bytes) => {
        const dt = new DataTransfer();
        dt.items.add(new File([new Uint8Array(bytes)], 'pasted-notes.md', { type: 'text/markdown' }));
        document.getElementById('input').dispatchEvent(
            new ClipboardEvent('paste', { clipboardData: dt, bubbles: true, cancelable: true }));
    }""", list(NOTES.encode()))
    page.wait_for_selector("#attachments .chip:not(.uploading) >> text=pasted-notes.md")
    assert page.input_value("#input") == ""  # the file went up, its bytes were not pasted as text

    send_and_wait(page, "Where is the spare key to the greenhouse?")
    assert page.locator("#messages .message.assistant .source").first.inner_text().startswith("[1] pasted-notes.md")
    assert page.console_errors == [] and page.dialogs == []
