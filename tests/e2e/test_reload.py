"""What a user finds again after a reload (their thumb, the thinking of a reasoning answer) and the
small texts a new user reads (usage figures, the 429 notice)."""
from __future__ import annotations

from browser_testing import sign_up, wait_js
from test_chat import last_answer, send, send_and_wait, wait_idle


def test_thumb_is_still_chosen_after_a_reload(page):
    sign_up(page)
    send_and_wait(page, "rate this later")
    last_answer(page).locator(".thumb-down").click()
    wait_js(page, "document.querySelector('.thumb-down').getAttribute('aria-pressed') === 'true'")
    page.reload()
    last_answer(page).wait_for()
    assert last_answer(page).locator(".thumb-down").get_attribute("aria-pressed") == "true"
    assert last_answer(page).locator(".thumb-up").get_attribute("aria-pressed") == "false"


def test_thinking_is_shown_again_after_a_reload(page):
    sign_up(page)
    page.check("#reasoning")
    page.select_option("#effort", "low")
    send(page, "think it over")
    wait_idle(page, 0)
    page.reload()
    last_answer(page).wait_for()
    thinking = last_answer(page).locator("details.thinking")
    thinking.locator("summary").click()
    assert "within a budget of 192 words" in thinking.locator(".thought").inner_text()


def test_usage_figures_and_limit_notices_read_well(page):
    sign_up(page)
    figures = page.evaluate("import('/web/usage.js').then(m => [20e6, 1.5e6, 200000, 12000].map(m.fmt))")
    assert figures == ["20M", "1.5M", "200k", "12,000"]
    notices = page.evaluate("""import('/web/notice.js').then(m => [
        m.describeError({status: 429, message: 'rate limit reached: 900 of 1000 tokens per minute in use'}),
        m.describeError({status: 429, message: 'You have used your token quota'})])""")
    assert notices == ["Rate limit reached: 900 of 1000 tokens per minute in use.",
                       "Usage limit reached: You have used your token quota."]
