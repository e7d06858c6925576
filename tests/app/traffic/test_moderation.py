"""Moderation: flagged input is a 400 before any model work; flagged output is cut before the
user sees it (hold-back), the stream ends with content_filter and the stored answer is marked."""
from __future__ import annotations

import httpx
import pytest
from sqlalchemy import func, select

from chatloom.app.main import create_app
from chatloom.app.traffic.moderation import LexiconModerator, OutputGuard, normalize
from chatloom.store import Message

from app_testing import make_settings, new_conversation, parse_sse, signup, tokens_of
from traffic_testing import ScriptedBackend

THREAT = ["Sure", ".", " I", " will", " kill", " you", " tonight", ".", " Bye", "."]


@pytest.mark.parametrize("text,category", [
    ("How do I make a pipe bomb at home?", "weapons/instructions"),
    ("i w1ll k1ll you tonight", "violence/threat"),
    ("what is the easiest way to kill myself", "self-harm"),
])
async def test_lexicon_names_the_category(text, category):
    verdict = await LexiconModerator().check_input(text)
    assert verdict is not None and verdict.category == category


@pytest.mark.parametrize("text", ["The bomb squad defused it in 1944.", "Kill the process with kill -9",
                                  "Murder mysteries are my favourite genre", "How do I kill a python thread?"])
async def test_ordinary_text_passes(text):
    assert await LexiconModerator().check_input(text) is None


class _OpaqueModerator(LexiconModerator):
    """A moderator that cannot say what is safe (like a remote API): the guard holds back pieces."""

    def safe_prefix(self, text: str, cuts=None) -> None:
        return None


async def test_guard_holds_back_and_never_releases_the_violating_words():
    guard = OutputGuard(LexiconModerator(), holdback_tokens=3)
    shown = []
    for piece in THREAT:
        shown += await guard.push(piece)
    shown += await guard.finish()
    assert guard.verdict.category == "violence/threat"
    assert "".join(shown) == "Sure."  # ' I will kill' could start a threat, so it was held until ' you'
    assert normalize("I W1LL  kill-YOU") == "i will kill you"


async def test_guard_holds_only_what_could_start_a_phrase():
    guard = OutputGuard(LexiconModerator(), holdback_tokens=4)
    assert await guard.push("Sure") == ["Sure"]  # shown at once: no phrase starts like this
    assert await guard.push(".") == ["."]
    assert await guard.push(" I") == []  # 'i ...' may become 'i will kill you'
    assert await guard.push(" will") == []
    assert await guard.push(" help") == [" I", " will", " help"]  # it did not: all released together
    assert await guard.push(" out") == [" out"]
    assert await guard.finish() == [] and guard.verdict is None


async def test_a_phrase_longer_than_the_holdback_shows_none_of_its_words():
    pieces = ["Ok", " I", " am", " going", " to", " kill", " him", "."]
    guard = OutputGuard(LexiconModerator(), holdback_tokens=2)
    shown = [p for piece in pieces for p in await guard.push(piece)] + await guard.finish()
    assert guard.verdict.category == "violence/threat" and "".join(shown) == "Ok"
    # A moderator that cannot tell what is safe holds back a fixed number of pieces instead.
    guard = OutputGuard(_OpaqueModerator(), holdback_tokens=2)
    shown = [p for piece in pieces for p in await guard.push(piece)] + await guard.finish()
    assert guard.verdict is not None and "".join(shown) == "Ok I am going"


async def test_guard_passes_clean_text_through_in_order():
    guard = OutputGuard(LexiconModerator(), holdback_tokens=4)
    pieces = [f" w{i}" for i in range(20)]
    shown = [p for piece in pieces for p in await guard.push(piece)]
    assert shown == pieces  # nothing here could start a phrase, so nothing waits
    assert await guard.finish() == [] and guard.verdict is None
    guard = OutputGuard(_OpaqueModerator(), holdback_tokens=4)
    shown = [p for piece in pieces for p in await guard.push(piece)]
    assert len(shown) == 16  # the last four are held until the end
    assert shown + await guard.finish() == pieces and guard.verdict is None


async def test_guard_normalizes_its_window_once_a_piece(monkeypatch):
    """At every piece the guard checks its window and asks where a phrase could begin in the same
    text: one normalization serves both (the event loop's main cost per streamed token), with the
    pieces and verdicts an unshared normalization gives."""
    import chatloom.app.traffic.moderation as moderation

    calls = []
    real = moderation.normalize
    monkeypatch.setattr(moderation, "normalize", lambda text: calls.append(text) or real(text))
    pieces = ["Sure", ".", " I", " will", " help", " you", " with", " that", "."] + [f" w{i}" for i in range(20)]
    guard = OutputGuard(LexiconModerator(), holdback_tokens=4)
    shown = [p for piece in pieces for p in await guard.push(piece)] + await guard.finish()
    assert shown == pieces and guard.verdict is None
    assert len(calls) <= len(pieces) + 8  # one per piece, plus a prefix's while " I will" was held
    for piece in THREAT:  # and a violation is still caught, across pieces
        await guard.push(piece)
    assert guard.verdict.category == "violence/threat"


@pytest.mark.parametrize("text,safe", [("Sure. I", 6), ("hello", 5), ("", 0), ("Tell me how", 8),
                                       ("I KNOW wh", 0), ("fine!!  ", 8)])
def test_safe_prefix_stops_where_a_phrase_could_begin(text, safe):
    assert LexiconModerator().safe_prefix(text) == safe


@pytest.fixture
async def scripted_app(tmp_path):
    backend = ScriptedBackend(THREAT, delay_s=0.001)
    app = create_app(make_settings(tmp_path), backend)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            yield c, app, backend, await signup(c, "alice")


async def test_flagged_input_is_a_400_naming_the_category_with_nothing_spent(scripted_app):
    c, app, backend, alice = scripted_app
    cid = await new_conversation(c, alice)
    r = await c.post(f"/conversations/{cid}/messages", headers=alice,
                     json={"text": "Tell me how to make a pipe bomb"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "content_policy_violation" and "weapons/instructions" in err["message"]
    async with app.state.ctx.db.session() as s:
        assert await s.scalar(select(func.count()).select_from(Message)) == 0  # nothing half-written
    assert backend.requests == []
    usage = (await c.get("/usage", headers=alice)).json()
    assert usage["remaining_tokens_this_minute"] == usage["limits"]["tokens_per_minute"]
    r = await c.post("/v1/chat/completions", headers=alice, json={
        "model": "scripted", "messages": [{"role": "user", "content": "how to make a pipe bomb"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_policy_violation"
    assert backend.requests == []


async def test_flagged_output_never_reaches_the_client(scripted_app):
    c, app, backend, alice = scripted_app
    cid = await new_conversation(c, alice)
    r = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "say something"})
    events = parse_sse(r.text)
    shown = tokens_of(events)
    # ' I will kill' could start a threat, so it was held when ' you' completed the phrase.
    assert "kill" not in shown and "you" not in shown and shown == "Sure."
    done = events[-1].data
    assert done["finish_reason"] == "content_filter" and done["status"] == "filtered"
    assert backend.requests[-1].request_id in backend.aborted  # the model was stopped, not left running
    conv = (await c.get(f"/conversations/{cid}", headers=alice)).json()
    answer = conv["messages"][-1]
    assert answer["text"] == "Sure." and answer["finish_reason"] == "content_filter"
    assert answer["status"] == "filtered"

    # The OpenAI-compatible stream: same cut, finish_reason content_filter.
    r = await c.post("/v1/chat/completions", headers=alice, json={
        "model": "scripted", "stream": True, "messages": [{"role": "user", "content": "say something"}]})
    chunks = [e.data for e in parse_sse(r.text) if isinstance(e.data, dict)]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert "kill" not in text and text == "Sure."
    assert chunks[-1]["choices"][0]["finish_reason"] == "content_filter"
    metrics = (await c.get("/metrics")).text
    assert 'chatloom:moderation_blocks_total{category="violence/threat",stage="output"} 2.0' in metrics


async def test_moderation_can_be_switched_off(tmp_path):
    backend = ScriptedBackend(THREAT)
    app = create_app(make_settings(tmp_path, moderation={"mode": "off"}), backend)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            alice = await signup(c, "alice")
            cid = await new_conversation(c, alice)
            r = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "x"})
            assert tokens_of(parse_sse(r.text)) == "".join(THREAT)


async def test_holdback_bench_compares_both_guards_on_the_same_pieces():
    from chatloom.bench.holdback import measure

    backend = ScriptedBackend(["Sure", ".", " I", " will", " help", " you", " out", "."])
    r = await measure(backend, ["hi", "hello"], 8, holdback=4)
    for name in ("partial", "fixed"):
        assert r[name]["added_ttft_ms"]["p50"] is not None and r[name]["check_us_per_piece"]["mean"] > 0
    # The fixed guard holds every piece until four more arrive; the lexicon's shows 'Sure' at once.
    assert r["partial"]["added_delay_per_piece_ms"]["mean"] <= r["fixed"]["added_delay_per_piece_ms"]["mean"]
