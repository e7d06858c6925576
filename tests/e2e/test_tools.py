"""An answer that uses the calculator, in Chromium: the step appears as a collapsible block with the
arguments and the result, the answer reports the result, and both are still there after a reload.
The scripted backend plays the model (it calls the calculator for 'calculate ...'); the tool, the
orchestrator loop, the SSE events, the storage and the page are the real ones."""
from __future__ import annotations

import pytest

from app_testing import LiveServer, make_settings
from browser_testing import DESKTOP, screenshot, sign_up, wait_js
from conftest import _new_page
from scripted_backend import ScriptedBackend
from test_chat import last_answer, send

from chatloom.app.main import create_app


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("e2e-tools"), sampling={"max_tokens": 1000}, chat={"tools": "calculator,time,search"})
    with LiveServer(create_app(settings, ScriptedBackend())) as live:
        yield live


@pytest.fixture
def tools_page(browser, tools_server):
    context, page = _new_page(browser, tools_server, DESKTOP)
    yield page
    context.close()


def test_an_answer_using_the_calculator_shows_the_step_and_the_result(tools_page):
    page = tools_page
    sign_up(page)
    send(page, "please calculate 1234 * 5678")
    # Two rounds of the scripted model and a tool run: give a loaded machine time.
    wait_js(page, "Number(document.body.dataset.answers || 0) > 0", timeout_s=60)
    answer = last_answer(page)
    step = answer.locator("details.tool-step")
    assert step.count() == 1
    assert step.locator("summary").inner_text() == "Used calculator: 7006652"
    assert not step.evaluate("d => d.open")  # collapsed until asked
    step.locator("summary").click()
    assert '"expression": "1234 * 5678"' in step.locator(".tool-args").inner_text()
    assert step.locator(".tool-result").inner_text() == "7006652"
    assert "The answer is 7006652." in answer.locator(".bubble").inner_text()
    assert "<tool_call>" not in answer.locator(".bubble").inner_text()
    screenshot(page, "desktop-tool-step")
    page.reload()
    last_answer(page).wait_for()
    assert last_answer(page).locator("details.tool-step summary").inner_text() == "Used calculator: 7006652"
    assert page.console_errors == [] and page.dialogs == []


@pytest.fixture(scope="module")
def code_server(tmp_path_factory):
    from chatloom.app.tools.code_interpreter import CodeInterpreter
    from chatloom.settings.tree import ToolsSettings
    data = tmp_path_factory.mktemp("e2e-code")
    problem = CodeInterpreter(ToolsSettings(), data).sandbox.problem()
    if problem:
        pytest.skip(f"the sandbox cannot run here: {problem}")
    settings = make_settings(data, sampling={"max_tokens": 1000}, chat={"tools": "python"})
    with LiveServer(create_app(settings, ScriptedBackend())) as live:
        yield live


def test_a_code_step_shows_highlighted_code_its_output_a_plot_and_a_download(browser, code_server):
    context, page = _new_page(browser, code_server, DESKTOP)
    try:
        sign_up(page)
        send(page, "run python: import matplotlib.pyplot as plt; plt.plot([1, 3, 2]); "
                   "open('table.csv', 'w').write('a,b'); print(6 * 7)")
        wait_js(page, "Number(document.body.dataset.answers || 0) > 0", timeout_s=90)
        step = last_answer(page).locator("details.code-step")
        assert step.count() == 1
        assert step.locator("summary").first.inner_text() == "Ran Python"
        assert step.evaluate("d => d.open")  # a plot opens the step
        assert step.locator(".tool-code .hl-kw").first.inner_text() == "import"
        assert "print(6 * 7)" in step.locator(".tool-code").inner_text()
        step.locator(".tool-output summary").click()
        assert step.locator(".tool-stdout").inner_text().strip() == "42"
        wait_js(page, "[...document.querySelectorAll('img.tool-plot')].some(i => i.complete && i.naturalWidth > 0)",
                timeout_s=30)
        link = step.locator("a.tool-file")
        assert link.inner_text() == "table.csv (3 bytes)"
        with page.expect_download() as download:
            link.click()
        assert download.value.suggested_filename == "table.csv"
        with open(download.value.path(), "rb") as f:
            assert f.read() == b"a,b"
        screenshot(page, "desktop-code-step")
        assert page.console_errors == [] and page.dialogs == []
    finally:
        context.close()
