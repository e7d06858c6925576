"""The one generation pipeline, seen from both APIs: the same caps, refusals, cleanup and figures."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import httpx
import pytest

from chatloom.app.main import create_app
from chatloom.settings import Settings, SettingsError, load_settings
from chatloom.engine import EngineConfig
from chatloom.serving import Delta, LocalBackend

from app_testing import done_of, make_settings, new_conversation, parse_sse, send, signup, tokens_of
from traffic_testing import ScriptedBackend

CHAT = "/v1/chat/completions"


@asynccontextmanager
async def scripted(tmp_path, backend=None, **settings):
    backend = backend or ScriptedBackend()
    app = create_app(make_settings(tmp_path, **settings), backend)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            yield c, app, backend, await signup(c, "alice")


def chat(text: str, **extra) -> dict:
    return {"model": "scripted", "messages": [{"role": "user", "content": text}], **extra}


# -- refused at once, before quota and admission ------------------------------------------------

async def test_overlong_prompt_is_refused_at_once_on_both_apis(tmp_path):
    # room=False: anything that reached the admission queue would wait there and end in a 503.
    async with scripted(tmp_path, ScriptedBackend(room=False), traffic={"queue_max_wait_s": 5}) as (c, app, backend, alice):
        long = "word " * 5000  # the scripted window is 4096 tokens
        cid = await new_conversation(c, alice)
        t0 = time.monotonic()
        r1 = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": long})
        r2 = await c.post(CHAT, headers=alice, json=chat(long))
        r3 = await c.post("/v1/completions", headers=alice, json={"model": "scripted", "prompt": long})
        assert time.monotonic() - t0 < 2
        for r, param in ((r1, "text"), (r2, "messages"), (r3, "prompt")):
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == param, err
        usage = (await c.get("/usage", headers=alice)).json()
        assert usage["remaining_tokens_this_minute"] == usage["limits"]["tokens_per_minute"]  # nothing reserved
        assert backend.requests == [] and app.state.ctx.traffic.admission.waiting == 0


async def test_request_larger_than_the_kv_pool_is_refused_at_once(tmp_path, tiny_model_fp32):
    # A pool of 4 blocks (64 tokens) is smaller than the model's window: the pool is the real limit.
    backend = LocalBackend(tiny_model_fp32, engine_config=EngineConfig(num_blocks=4, max_num_seqs=2))
    await backend.start()
    try:
        assert backend.context_window == 64
        app = create_app(make_settings(tmp_path, traffic={"queue_max_wait_s": 5}), backend)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                alice = await signup(c, "alice")
                t0 = time.monotonic()
                r = await c.post(CHAT, headers=alice, json={**chat("x" * 200), "model": "tiny-random"})
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
                cid = await new_conversation(c, alice)
                r = await c.post(f"/conversations/{cid}/messages", headers=alice,
                                 json={"text": "x" * 200, "max_tokens": 4})
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
                assert time.monotonic() - t0 < 3
                # A request that fits is clamped to the room the prompt leaves, and answered.
                r = await c.post(CHAT, headers=alice, json={**chat("hi"), "model": "tiny-random", "max_tokens": 60})
                assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
                assert r.json()["usage"]["total_tokens"] <= 64  # 60 asked for did not fit after the prompt
    finally:
        await backend.close()


async def test_max_tokens_limit_holds_on_both_apis(tmp_path):
    async with scripted(tmp_path, sampling={"max_tokens_limit": 100}) as (c, app, backend, alice):
        cid = await new_conversation(c, alice)
        r1 = await c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hi", "max_tokens": 101})
        r2 = await c.post(CHAT, headers=alice, json=chat("hi", max_tokens=101))
        for r in (r1, r2):
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert backend.requests == []


async def test_reasoning_budget_is_clamped_the_same_way_on_both_apis(tmp_path):
    async with scripted(tmp_path) as (c, app, backend, alice):
        cid = await new_conversation(c, alice)
        await send(c, alice, cid, "hi", max_tokens=1000, reasoning_effort="high")
        r = await c.post(CHAT, headers=alice, json=chat("hi", max_tokens=1000, reasoning_effort="high"))
        assert r.status_code == 200
        window = backend.context_window
        # 1000 + the high budget (4096) is more than the window allows: both get (window + 1000) // 2.
        assert [q.max_tokens for q in backend.requests] == [(window + 1000) // 2] * 2


# -- a character cut by max_tokens -----------------------------------------------------------------

class CutBackend(ScriptedBackend):
    """Ends like an engine whose last token held half of 'é': the final delta decodes to U+FFFD."""

    async def stream(self, request):
        self.requests.append(request)
        yield Delta("Caf", False, None, 5, 1)
        yield Delta("\ufffd", True, "length", 5, 2)


async def test_a_character_cut_by_max_tokens_is_dropped_on_both_apis(tmp_path):
    async with scripted(tmp_path, CutBackend()) as (c, app, backend, alice):
        cid = await new_conversation(c, alice)
        _, events = await send(c, alice, cid, "hi", max_tokens=2)
        assert tokens_of(events) == "Caf" and done_of(events)["finish_reason"] == "length"
        conv = (await c.get(f"/conversations/{cid}", headers=alice)).json()
        assert conv["messages"][-1]["text"] == "Caf"
        r = await c.post(CHAT, headers=alice, json=chat("hi", max_tokens=2))
        assert r.json()["choices"][0]["message"]["content"] == "Caf"
        r = await c.post(CHAT, headers=alice, json=chat("hi", max_tokens=2, stream=True))
        assert "\ufffd" not in r.text and "\\ufffd" not in r.text
        r = await c.post("/v1/completions", headers=alice, json={"model": "scripted", "prompt": "hi", "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == "Caf"


# -- feedback and reasoning read back ------------------------------------------------------------------

async def test_feedback_is_on_the_message_and_admins_can_list_it(tmp_path):
    async with scripted(tmp_path) as (c, app, backend, alice):
        bob = await signup(c, "bob")
        cid = await new_conversation(c, bob)
        _, events = await send(c, bob, cid, "rate me")
        answer_id = done_of(events)["message_id"]
        assert (await c.get(f"/messages/{answer_id}/feedback", headers=bob)).status_code == 404
        r = await c.post(f"/messages/{answer_id}/feedback", headers=bob, json={"rating": "down", "text": "meh"})
        assert r.status_code == 201
        conv = (await c.get(f"/conversations/{cid}", headers=bob)).json()
        assert conv["messages"][-1]["feedback"] == "down" and conv["messages"][0]["feedback"] is None
        mine = (await c.get(f"/messages/{answer_id}/feedback", headers=bob)).json()
        assert mine["rating"] == "down" and mine["text"] == "meh"
        assert (await c.get(f"/messages/{answer_id}/feedback", headers=alice)).status_code == 404  # not hers
        assert (await c.get("/admin/feedback", headers=bob)).status_code == 403
        items = (await c.get("/admin/feedback", headers=alice)).json()  # alice signed up first: admin
        assert [(i["username"], i["rating"], i["message_id"]) for i in items] == [("bob", "down", answer_id)]
        assert items[0]["conversation_id"] == cid and items[0]["answer"].startswith("Hello")
        assert (await c.get("/admin/feedback?rating=up", headers=alice)).json() == []
        assert (await c.get("/admin/feedback?rating=meh", headers=alice)).status_code == 422


async def test_reasoning_is_stored_with_the_answer(tmp_path):
    backend = ScriptedBackend(["<think>", "Weigh", " it", ".", "</think>", "Yes", "."])
    async with scripted(tmp_path, backend) as (c, app, _, alice):
        cid = await new_conversation(c, alice)
        _, events = await send(c, alice, cid, "well?", reasoning_effort="low")
        assert "".join(e.data["thinking"] for e in events if "thinking" in e.data) == "Weigh it."
        answer = (await c.get(f"/conversations/{cid}", headers=alice)).json()["messages"][-1]
        assert answer["text"] == "Yes." and answer["reasoning"] == "Weigh it."
        r = await c.post(CHAT, headers=alice, json=chat("well?", reasoning_effort="low"))
        message = r.json()["choices"][0]["message"]
        assert message["content"] == "Yes." and message["reasoning_content"] == "Weigh it."


# -- /v1/completions ---------------------------------------------------------------------------------

async def test_completions_with_text_and_token_ids(client, alice, tiny_backend):
    body = {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    r = await client.post("/v1/completions", headers=alice, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"][0]["finish_reason"] == "length" and isinstance(out["choices"][0]["text"], str)
    assert out["usage"]["completion_tokens"] == 6 and out["usage"]["prompt_tokens"] > 0
    ids = tiny_backend.tokenizer.encode("Once upon a time")
    by_ids = (await client.post("/v1/completions", headers=alice, json={**body, "prompt": ids})).json()
    assert by_ids["choices"][0]["text"] == out["choices"][0]["text"]  # the same prompt, greedy
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    r = await client.post("/v1/completions", headers=alice, json={**body, "prompt": [ids], "stream": True,
                                                                "stream_options": {"include_usage": True}})
    chunks = [e.data for e in parse_sse(r.text) if isinstance(e.data, dict)]
    assert parse_sse(r.text)[-1].data == "[DONE]"
    assert all(ch["object"] == "text_completion" for ch in chunks)
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == out["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    usage = (await client.get("/usage", headers=alice)).json()
    assert usage["totals"]["requests"] == 3  # metered like every other answer


@pytest.mark.parametrize("prompt,code", [(["a", ""], "invalid_value"), ([[1], []], "invalid_value"),
                                          ("", "invalid_value"), ([10**9], "invalid_request"), ([], "invalid_value")])
async def test_bad_completion_prompts(client, alice, prompt, code):
    r = await client.post("/v1/completions", headers=alice, json={"model": "tiny-random", "prompt": prompt})
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text


async def test_completion_options_that_cannot_be_honoured(client, alice):
    for extra, param in (({"suffix": "x"}, "suffix"), ({"n": 9}, "n"), ({"best_of": 3}, "best_of"),
                         ({"logprobs": 6}, "logprobs")):
        r = await client.post("/v1/completions", headers=alice,
                              json={"model": "tiny-random", "prompt": "hi", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param


# -- goodput ----------------------------------------------------------------------------------------------

def _sample(metrics: str, name: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.parametrize("ttft,counted", [(2.0, 1.0), (0.001, 0.0)])
async def test_goodput_under_the_slo_on_metrics(tmp_path, ttft, counted):
    # The scripted engine reports ttft 10 ms, tpot 2 ms.
    async with scripted(tmp_path, traffic={"slo_ttft_s": ttft, "slo_tpot_s": 0.05}) as (c, app, backend, alice):
        cid = await new_conversation(c, alice)
        await send(c, alice, cid, "hi")
        assert (await c.post(CHAT, headers=alice, json=chat("hi"))).status_code == 200
        metrics = (await c.get("/metrics")).text
        assert _sample(metrics, "vllm:request_success_total") == 2.0
        assert (_sample(metrics, "chatloom:goodput_requests_total") or 0.0) == 2 * counted
        assert _sample(metrics, "chatloom:slo_ttft_seconds") == ttft
        assert _sample(metrics, "chatloom:goodput_requests_per_s") == pytest.approx(2 * counted / 60)


async def test_routes_declare_what_they_return(tmp_path):
    async with scripted(tmp_path) as (c, app, backend, alice):
        schema = (await c.get("/openapi.json")).json()
    names = set(schema["components"]["schemas"])
    assert {"ConversationDetail", "MessageOut", "StatsOut", "BackendStats", "MyUsage", "FeedbackItem",
            "SessionOut", "ModelList"} <= names
    read = schema["paths"]["/conversations/{conversation_id}"]["get"]["responses"]["200"]
    assert read["content"]["application/json"]["schema"]["$ref"].endswith("/ConversationDetail")
    assert "feedback" in schema["components"]["schemas"]["MessageOut"]["properties"]


# -- settings -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("toml,words", [('[model]\nname = ["a", "b"]', "setting model.name: input should be a valid string"),
                                        ('[server]\nport = "80"', "setting server.port: input should be a valid integer, not '80'"),
                                        ("[engine]\nkv_cache_gb = true", "setting engine.kv_cache_gb: input should be a valid number, not True"),
                                        ("[model]\nname = ", "not valid TOML"),
                                        ("port = 80", "port is outside any table: settings go in \\[group\\] tables .* it belongs in \\[server\\]")])
def test_settings_file_with_a_wrong_value_is_one_clear_error(tmp_path, toml, words):
    path = tmp_path / "bad.toml"
    path.write_text(toml + "\n")
    with pytest.raises(SettingsError, match=words) as err:
        load_settings(path)
    assert "\n" not in str(err.value)


def test_engine_sizing_defaults_are_the_engines():
    s, e = Settings(), EngineConfig()
    assert (s.engine.kv_cache_gb, s.engine.max_num_seqs, s.engine.max_num_batched_tokens, s.engine.num_blocks) == \
        (e.kv_cache_gb, e.max_num_seqs, e.max_num_batched_tokens, e.num_blocks)
    assert EngineConfig.from_settings(Settings(engine={"max_num_seqs": 7, "context_window": 99}).engine) == \
        EngineConfig(max_num_seqs=7, max_model_len=99)


async def test_stop_while_queued_still_settles_through_the_pipeline(tmp_path):
    async with scripted(tmp_path, ScriptedBackend(room=False), traffic={"queue_max_wait_s": 5}) as (c, app, backend, alice):
        cid = await new_conversation(c, alice)
        sending = asyncio.create_task(c.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hi"}))
        await asyncio.sleep(0.2)
        assert (await c.post(f"/conversations/{cid}/stop", headers=alice)).json()["stopped"] is True
        events = parse_sse((await sending).text)
        assert events[-1].data["status"] == "stopped" and backend.requests == []
        usage = (await c.get("/usage", headers=alice)).json()
        assert usage["remaining_tokens_this_minute"] == usage["limits"]["tokens_per_minute"]


class _Watching(ScriptedBackend):
    """Records each hold of background work with how many deltas it had streamed by then."""

    def __init__(self) -> None:
        super().__init__(pieces=[f" word{i}" for i in range(10)], delay_s=0.005)
        self.holds: list[tuple[bool, int]] = []
        self.streamed = 0

    def hold_background(self, held: bool) -> None:
        self.holds.append((held, self.streamed))

    async def stream(self, request):
        async for delta in super().stream(request):
            self.streamed += 1
            yield delta


async def test_batch_work_is_held_until_the_first_piece_passes_the_output_check(tmp_path, monkeypatch):
    from chatloom.app.traffic.moderation import LexiconModerator

    # A moderator that cannot tell a safe prefix (a remote one): the newest 4 pieces are held back.
    monkeypatch.setattr(LexiconModerator, "safe_prefix", lambda self, text, cuts: None)
    backend = _Watching()
    async with scripted(tmp_path, backend, moderation={"mode": "lexicon", "holdback_tokens": 4}) as (c, app, _, alice):
        r = await c.post(CHAT, headers=alice, json=chat("hi", stream=True))
        assert r.status_code == 200
        # Held from admission until the first piece got past the 4 held back: not at the engine's first token.
        assert [held for held, _ in backend.holds] == [True, False]
        assert backend.holds[0][1] == 0 and backend.holds[1][1] >= 5
    assert backend.holds[-1][0] is False  # and let go when the gateway stops


async def test_the_backend_hears_what_the_class_ttft_target_leaves(tmp_path):
    """A router places by the time to first token the request's class has left (serving/routing.py):
    a chat message's target, a reasoning request's own, none when the class has no target."""
    async with scripted(tmp_path, traffic={"slo_ttft_s": 2.0, "slo_classes": {"reasoning": {"ttft_s": 10.0}}}) \
            as (c, app, backend, alice):
        assert (await c.post(CHAT, headers=alice, json=chat("hi"))).status_code == 200
        assert (await c.post(CHAT, headers=alice, json=chat("hi", reasoning_effort="low"))).status_code == 200
        chat_left, reasoning_left = (r.ttft_target_s for r in backend.requests)
        assert 0 < chat_left <= 2.0 and 8.0 < reasoning_left <= 10.0
    async with scripted(tmp_path / "none", traffic={"slo_ttft_s": None}) as (c, app, backend, alice):
        assert (await c.post(CHAT, headers=alice, json=chat("hi"))).status_code == 200
        assert backend.requests[0].ttft_target_s is None
