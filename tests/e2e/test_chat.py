"""The chat app in Chromium: sign up, streaming, stop, regenerate and siblings, edit and branch,
reload mid-answer, delete, quota errors, injection, phone layout."""
from __future__ import annotations

import re
import time

from browser_testing import screenshot, sign_up, unique_name, wait_js

ASSISTANT = "#messages .message.assistant"


def last_answer(page):
    return page.locator(ASSISTANT).last


def answers_finished(page) -> int:
    return int(page.evaluate("document.body.dataset.answers || '0'"))


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def answer_text(page) -> str:
    return last_answer(page).locator(".bubble").inner_text()


def wait_idle(page, finished_before: int) -> None:
    """Until the answer started after `finished_before` answers has finished and the page has settled."""
    wait_js(page, f"Number(document.body.dataset.answers || 0) > {finished_before}", timeout_s=20)
    assert page.locator("#send").is_visible() and page.locator(".message.streaming").count() == 0


def send_and_wait(page, text: str) -> None:
    before = answers_finished(page)
    send(page, text)
    wait_idle(page, before)


def sample_growth(page, until_chars: int = 10_000, samples: int = 6, interval_s: float = 0.12) -> list[int]:
    """Lengths of the streaming answer over a few frames."""
    page.wait_for_selector(".message.streaming")
    lengths = []
    for _ in range(samples):
        lengths.append(len(page.locator(".message.streaming .bubble").inner_text()))
        if lengths[-1] >= until_chars:
            break
        time.sleep(interval_s)
    return lengths


def test_sign_up_and_stream_a_markdown_answer(page):
    page.goto("/")
    page.wait_for_selector("#auth:not([hidden])")
    screenshot(page, "desktop-login")
    sign_up(page)
    send(page, "Show me some markdown please")
    # The answer grows across several frames before it is complete, with a stop button meanwhile.
    page.wait_for_selector("#stop:not([hidden])")
    lengths = sample_growth(page)
    growing = [b for a, b in zip(lengths, lengths[1:]) if b > a]
    assert len(growing) >= 2, lengths
    wait_idle(page, 0)
    answer = last_answer(page)
    assert answer.locator("h2").inner_text() == "A short answer"
    assert answer.locator("strong").first.inner_text() == "bold"
    assert answer.locator("pre code.language-python").inner_text().startswith("def greet(name):")
    assert "<nobody>" in answer.locator("pre code").inner_text()  # shown as text, not a tag
    assert answer.locator("a").get_attribute("href") == "https://example.com/docs"
    assert answer.locator("li").count() == 2
    # The conversation is in the sidebar under its first message's title.
    assert page.locator(".conversation.active .open").inner_text() == "Show me some markdown please"
    assert page.locator("#title").inner_text() == "Show me some markdown please"
    # Shift+Enter makes a new line instead of sending.
    page.fill("#input", "line one")
    page.press("#input", "Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#input") == "line one\nline two"
    page.fill("#input", "")
    screenshot(page, "desktop-chat")
    assert not page.console_errors


def test_stop_mid_answer_with_the_button_and_with_esc(page):
    sign_up(page)
    send(page, "Tell me a long story")
    wait_js(page, "document.querySelector('.message.streaming .bubble')?.innerText.length > 20")
    page.click("#stop")
    wait_idle(page, 0)
    answer = last_answer(page)
    assert answer.get_attribute("data-status") == "stopped"
    assert "Stopped" in answer.locator(".status-line").inner_text()
    stopped_text = answer_text(page)
    assert 0 < len(stopped_text.split()) < 399
    # Esc stops too.
    send(page, "Another long one")
    wait_js(page, "document.querySelector('.message.streaming .bubble')?.innerText.length > 20")
    page.keyboard.press("Escape")
    wait_idle(page, 1)
    assert last_answer(page).get_attribute("data-status") == "stopped"
    time.sleep(0.3)
    assert last_answer(page).get_attribute("data-status") == "stopped"


def test_regenerate_and_move_between_siblings(page):
    sign_up(page)
    send_and_wait(page, "hello there")
    first = answer_text(page)
    page.click(f"{ASSISTANT} >> nth=-1 >> .regenerate")
    page.wait_for_selector(".message.streaming")
    wait_idle(page, 1)
    second = answer_text(page)
    assert second != first and second.startswith("Answer number")
    nav = last_answer(page).locator(".siblings")
    assert nav.locator(".position").inner_text() == "2/2"
    nav.locator(".prev").click()
    wait_js(page, "document.querySelector('#messages .message.assistant .position')?.innerText === '1/2'")
    assert answer_text(page) == first
    page.reload()  # the branch picked stays picked
    wait_js(page, "document.querySelector('#messages .message.assistant .position')?.innerText === '1/2'")
    assert answer_text(page) == first
    last_answer(page).locator(".siblings .next").click()
    wait_js(page, "document.querySelector('#messages .message.assistant .position')?.innerText === '2/2'")
    assert answer_text(page) == second


def test_edit_an_earlier_message_branches(page):
    sign_up(page)
    send_and_wait(page, "first question")
    send_and_wait(page, "second question")
    assert page.locator("#messages .message").count() == 4
    first_user = page.locator("#messages .message.user").first
    first_user.locator(".edit").click()
    page.fill(".edit-input", "edited question")
    page.click(".edit-box .save")
    page.wait_for_selector(".message.streaming")
    wait_idle(page, 2)
    # The new branch: the edited question and its answer only.
    users = page.locator("#messages .message.user .bubble")
    assert users.all_inner_texts() == ["edited question"]
    assert "edited question" in answer_text(page)
    assert page.locator("#messages .message.user .position").inner_text() == "2/2"
    # ‹ goes back to the original branch, with both turns.
    page.locator("#messages .message.user .prev").click()
    wait_js(page, "document.querySelectorAll('#messages .message').length === 4")
    assert page.locator("#messages .message.user .bubble").all_inner_texts() == ["first question", "second question"]
    assert page.locator("#messages .message.user .position").first.inner_text() == "1/2"
    screenshot(page, "desktop-branches")


def test_reload_mid_answer_reattaches_and_keeps_the_stop_button(page):
    sign_up(page)
    send(page, "a long answer please")
    wait_js(page, "document.querySelector('.message.streaming .bubble')?.innerText.length > 30")
    before = len(page.locator(".message.streaming .bubble").inner_text())
    assert "chatloom.stream" in page.evaluate("Object.keys(sessionStorage)")
    page.reload()
    page.wait_for_selector(".message.streaming")
    assert page.locator("#stop").is_visible()
    # The text picks up where it was and keeps growing.
    wait_js(page, f"document.querySelector('.message.streaming .bubble')?.innerText.length > {before + 40}")
    screenshot(page, "desktop-streaming")
    page.click("#stop")
    wait_idle(page, 0)
    answer = last_answer(page)
    assert answer.get_attribute("data-status") == "stopped"
    words = answer_text(page).split()
    assert words[:5] == ["word1", "word2", "word3", "word4", "word5"]
    assert words == [f"word{i}" for i in range(1, len(words) + 1)]  # nothing lost or doubled
    assert page.evaluate("sessionStorage.getItem('chatloom.stream')") is None


def test_rename_and_delete_conversations(page):
    sign_up(page)
    send_and_wait(page, "conversation one")
    page.click("#new-chat")
    send_and_wait(page, "conversation two")
    titles = page.locator(".conversation .open")
    assert titles.all_inner_texts() == ["conversation two", "conversation one"]  # newest first
    page.locator(".conversation").nth(1).hover()
    page.locator(".conversation").nth(1).locator(".rename").click()
    page.fill(".rename-input", "renamed one")
    page.press(".rename-input", "Enter")
    wait_js(page, "[...document.querySelectorAll('.conversation .open')].some(b => b.innerText === 'renamed one')")
    active = page.locator(".conversation.active")
    active.locator(".delete").click()
    active.locator(".yes").click()
    wait_js(page, "document.querySelectorAll('.conversation').length === 1")
    assert page.locator("#messages .message").count() == 0
    page.reload()
    page.wait_for_selector(".conversation")
    assert page.locator(".conversation .open").all_inner_texts() == ["renamed one"]


def test_quota_429_is_a_message_with_a_countdown(page):
    sign_up(page)
    body = '{"error": {"message": "You have used your token quota.", "type": "rate_limit_error", "code": "quota_exceeded"}}'
    page.route("**/conversations/*/messages", lambda route: route.fulfill(
        status=429, body=body, content_type="application/json", headers={"Retry-After": "2"}))
    send(page, "will this be refused")
    notice = page.locator("#notice")
    notice.wait_for()
    assert re.search(r"Usage limit reached: You have used your token quota\. Try again in [12] s\.", notice.inner_text())
    assert page.locator("#notice-retry").is_disabled()
    assert page.locator(ASSISTANT).count() == 0  # no broken answer
    assert page.input_value("#input") == "will this be refused"  # the text is kept for the retry
    screenshot(page, "desktop-quota")
    page.unroute("**/conversations/*/messages")
    page.wait_for_selector("#notice-retry:not([disabled])", timeout=5000)
    assert "You can try again now" in notice.inner_text()
    page.click("#notice-retry")
    wait_idle(page, 0)
    assert "will this be refused" in answer_text(page)
    assert page.input_value("#input") == ""
    assert notice.is_hidden()


def test_a_retry_after_a_lost_reply_sends_the_message_once(page):
    """The server stores and answers the message but the reply never reaches the page; the notice's
    Retry sends it again with the same Idempotency-Key, and the page shows the first send's answer."""
    sign_up(page)
    keys = []

    def lose_the_reply(route):
        route.fetch()  # the message reaches the server, which stores and answers it
        keys.append(route.request.headers.get("idempotency-key"))
        route.abort()  # ...and the page never hears back

    page.route("**/conversations/*/messages", lose_the_reply)
    send(page, "was this sent twice")
    notice = page.locator("#notice")
    notice.wait_for()
    assert "Cannot reach the server" in notice.inner_text()
    page.unroute("**/conversations/*/messages")
    keys_sent = []
    page.on("request", lambda r: keys_sent.append(r.headers.get("idempotency-key"))
            if r.method == "POST" and r.url.endswith("/messages") else None)
    page.wait_for_selector("#notice-retry:not([disabled])", timeout=10_000)
    page.click("#notice-retry")
    wait_idle(page, 0)
    assert "was this sent twice" in answer_text(page)
    assert keys_sent == keys and len(keys[0]) == 32  # the retry kept the first try's key
    page.reload()
    page.wait_for_selector(ASSISTANT)
    assert page.locator("#messages .message.user").count() == 1
    assert page.locator(ASSISTANT).count() == 1


def test_a_retry_after_a_lost_regenerate_reply_makes_one_new_answer(page):
    """As for a send: the retry of a regeneration whose reply was lost keeps its key, so the server
    streams the answer it already started instead of making a third sibling."""
    sign_up(page)
    send_and_wait(page, "hello there")
    keys = []

    def lose_the_reply(route):
        route.fetch()
        keys.append(route.request.headers.get("idempotency-key"))
        route.abort()

    page.route("**/messages/*/regenerate", lose_the_reply)
    page.click(f"{ASSISTANT} >> nth=-1 >> .regenerate")
    notice = page.locator("#notice")
    notice.wait_for()
    page.unroute("**/messages/*/regenerate")
    keys_sent = []
    page.on("request", lambda r: keys_sent.append(r.headers.get("idempotency-key"))
            if r.method == "POST" and r.url.endswith("/regenerate") else None)
    page.wait_for_selector("#notice-retry:not([disabled])", timeout=10_000)
    page.click("#notice-retry")
    wait_idle(page, 1)
    assert keys_sent == keys and len(keys[0]) == 32
    page.reload()
    page.wait_for_selector(ASSISTANT)
    wait_js(page, "document.querySelector('#messages .message.assistant .position')?.innerText === '2/2'")


def test_busy_503_from_the_server_is_a_message(page):
    sign_up(page)
    page.route("**/conversations/*/messages", lambda route: route.fulfill(
        status=503, body='{"error": {"message": "too many requests are waiting", "code": "queue_timeout"}}',
        content_type="application/json", headers={"Retry-After": "7"}))
    send(page, "busy?")
    page.locator("#notice").wait_for()
    assert "The server is busy: too many requests are waiting. Try again in 7 s." in page.locator("#notice").inner_text()


def test_injection_in_answers_and_messages_is_inert(page):
    sign_up(page)
    attack = 'please inject <img src=x onerror=alert(1)> <script>alert("u")</script> [x](javascript:alert(9))'
    send_and_wait(page, attack)
    page.wait_for_timeout(200)
    messages = page.locator("#messages")
    assert page.locator("[onerror], [onload], [onmouseover]").count() == 0
    assert messages.locator("script, iframe, object, embed").count() == 0
    assert messages.locator(".bubble img, .bubble svg").count() == 0
    hrefs = messages.locator("a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    assert all(h.startswith("https://") for h in hrefs), hrefs
    # The markup is shown as text.
    assert "<img src=x onerror=alert(1)>" in answer_text(page)
    assert '<script>alert("xss")</script>' in answer_text(page)
    assert "<img src=x onerror=alert(1)>" in page.locator("#messages .message.user .bubble").inner_text()
    assert page.dialogs == []
    assert not page.console_errors


def test_markdown_renderer_escapes_before_it_renders(page):
    page.goto("/")
    cases = page.evaluate("""async () => {
        const { renderMarkdown } = await import('/web/markdown.js');
        const box = document.createElement('div');
        const out = {};
        for (const [name, src] of Object.entries({
            img: '<img src=x onerror=alert(1)>',
            js_link: '[a](javascript:alert(1)) [b](JAVASCRIPT:alert(1)) [c](data:text/html,x)',
            quote_break: '[a](https://x.io/"onclick="alert(1))',
            code_tag: '```html\\n<script>alert(1)</script>\\n```',
            inline: '`<b>` **<i>x</i>**',
            heading: '# <h1 onclick=x>t',
        })) {
            box.innerHTML = renderMarkdown(src);
            out[name] = {
                html: box.innerHTML,
                handlers: [...box.querySelectorAll('*')].flatMap(e => [...e.attributes].map(a => a.name))
                    .filter(n => n.startsWith('on')),
                tags: [...box.querySelectorAll('*')].map(e => e.tagName.toLowerCase()),
                hrefs: [...box.querySelectorAll('a')].map(a => a.href),
            };
        }
        return out;
    }""")
    allowed = {"p", "a", "br", "strong", "em", "code", "pre", "div", "span", "button", "h1", "del"}
    for name, case in cases.items():
        assert case["handlers"] == [], (name, case)
        assert set(case["tags"]) <= allowed, (name, case)
        assert all(h.startswith("https://") for h in case["hrefs"]), (name, case)
    assert cases["js_link"]["hrefs"] == []
    assert cases["code_tag"]["tags"].count("pre") == 1 and "&lt;script&gt;" in cases["code_tag"]["html"]


def test_thinking_and_queue_position_render(page):
    page.goto("/")
    result = page.evaluate("""async () => {
        const { Run } = await import('/web/run.js');
        const { streamingMessage, updateStreaming } = await import('/web/messages.js');
        const run = new Run('c1', 'm1');
        const node = streamingMessage('m1');
        document.body.append(node);
        run.apply({ id: '1', data: { queue_position: 3 } });
        updateStreaming(node, run);
        const queued = node.querySelector('.queue').innerText;
        run.apply({ id: '2', data: { thinking: 'Let me think <b>hard</b>.' } });
        run.apply({ id: '3', data: { token: 'The answer' } });
        updateStreaming(node, run);
        const details = node.querySelector('details.thinking');
        return { queued, queueHidden: node.querySelector('.queue').hidden, thinkingHidden: details.hidden,
                 open: details.open, thought: details.querySelector('.thought').textContent,
                 bolds: details.querySelectorAll('b').length, text: node.querySelector('.bubble').innerText,
                 last: run.lastEventId };
    }""")
    assert result["queued"] == "Waiting in queue: position 3"
    assert result["queueHidden"] is True and result["thinkingHidden"] is False
    assert result["open"] is False  # thinking starts collapsed
    assert result["thought"] == "Let me think <b>hard</b>." and result["bolds"] == 0
    assert result["text"] == "The answer" and result["last"] == 3


def test_phone_layout_collapses_the_sidebar(phone_page):
    page = phone_page
    sign_up(page, unique_name("phone"))
    sidebar = page.locator("#sidebar")
    assert sidebar.bounding_box()["x"] + sidebar.bounding_box()["width"] <= 1  # off screen
    send_and_wait(page, "Show me some markdown please")
    screenshot(page, "phone-chat")
    page.click("#menu")
    wait_js(page, "document.querySelector('#sidebar').getBoundingClientRect().x >= 0")
    page.wait_for_timeout(250)
    screenshot(page, "phone-sidebar")
    page.locator(".conversation .open").first.click()
    wait_js(page, "document.querySelector('#sidebar').getBoundingClientRect().right <= 1")
    assert page.locator(ASSISTANT).count() == 1
    # Nothing scrolls sideways on a phone.
    assert page.evaluate("document.documentElement.scrollWidth") <= 390


def test_reasoning_effort_streams_collapsed_thinking(page):
    sign_up(page)
    assert page.locator("#effort").is_disabled()
    page.check("#reasoning")
    page.select_option("#effort", "low")
    send(page, "think about markdown")
    details = page.locator(".message.streaming details.thinking")
    details.wait_for()
    assert details.get_attribute("open") is None  # collapsed
    wait_idle(page, 0)
    answer = last_answer(page)
    thinking = answer.locator("details.thinking")
    assert thinking.get_attribute("open") is None
    thinking.locator("summary").click()
    # The effort reached the server: low is a 256-token budget, about 192 words.
    assert "within a budget of 192 words" in thinking.locator(".thought").inner_text()
    assert "<think>" not in answer_text(page) and answer.locator("h2").inner_text() == "A short answer"
    screenshot(page, "desktop-thinking")


def test_thumbs_and_usage(page):
    sign_up(page)
    send_and_wait(page, "rate this")
    up, down = last_answer(page).locator(".thumb-up"), last_answer(page).locator(".thumb-down")
    up.click()
    wait_js(page, "document.querySelector('.thumb-up').getAttribute('aria-pressed') === 'true'")
    down.click()
    wait_js(page, "document.querySelector('.thumb-down').getAttribute('aria-pressed') === 'true'")
    assert up.get_attribute("aria-pressed") == "false"
    assert page.locator("#notice").is_hidden()
    usage = page.locator("#usage")
    wait_js(page, "!document.querySelector('#usage').hidden")
    assert re.search(r"Today: [\d,]+( / [\d,k]+)? tokens", usage.inner_text()), usage.inner_text()


def test_without_usage_or_feedback_routes_the_page_degrades_quietly(page):
    page.route(re.compile(r"/usage(\?.*)?$"), lambda route: route.fulfill(status=404, body='{"error": {"message": "not found"}}',
                                                        content_type="application/json"))
    page.route("**/feedback", lambda route: route.fulfill(status=404, body='{"error": {"message": "not found"}}',
                                                          content_type="application/json"))
    sign_up(page)
    send_and_wait(page, "hi")
    assert page.locator("#usage").is_hidden()
    last_answer(page).locator(".thumb-up").click()
    page.locator("#notice").wait_for()
    assert page.locator("#notice-text").inner_text() == "Feedback is not available on this server."


def test_log_out_and_log_back_in(page):
    name = sign_up(page)
    send_and_wait(page, "remember me")
    page.click("#logout")
    page.wait_for_selector("#auth:not([hidden])")
    assert page.evaluate("localStorage.getItem('chatloom.token')") is None
    page.fill("#auth-username", name)
    page.fill("#auth-password", "wrong password")
    page.click("#login-button")
    page.wait_for_selector("#auth-error:not([hidden])")
    assert page.locator("#auth-error").inner_text() == "wrong username or password."
    page.fill("#auth-password", "correct horse battery")
    page.click("#login-button")
    page.wait_for_selector(".conversation")
    assert page.locator(".conversation .open").all_inner_texts() == ["remember me"]
