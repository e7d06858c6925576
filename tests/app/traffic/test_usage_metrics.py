"""Metering per user, day and model; feedback on answers; /metrics in Prometheus format."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from chatloom.app.main import create_app
from chatloom.app.traffic.metering import utc_day

from app_testing import done_of, make_settings, new_conversation, send, signup
from traffic_testing import ScriptedBackend


async def test_usage_is_metered_per_user_day_and_model(client, alice, bob):
    cid = await new_conversation(client, alice)
    _, events = await send(client, alice, cid, "Hello there", max_tokens=5)
    first = done_of(events)["usage"]
    _, events = await send(client, alice, cid, "And again", max_tokens=5)
    second = done_of(events)["usage"]
    r = await client.post("/v1/chat/completions", headers=bob, json={
        "model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200
    bob_usage = r.json()["usage"]

    mine = (await client.get("/usage", headers=alice)).json()
    assert mine["tier"] == "free" and len(mine["data"]) == 1
    row = mine["data"][0]
    assert row["day"] == utc_day() and row["model"] == "tiny-random" and row["requests"] == 2
    assert row["prompt_tokens"] == first["prompt_tokens"] + second["prompt_tokens"]
    assert row["completion_tokens"] == first["completion_tokens"] + second["completion_tokens"]
    assert row["cached_tokens"] > 0  # the second prompt starts with the first: prefix cache hits
    assert mine["totals"]["total_tokens"] == row["prompt_tokens"] + row["completion_tokens"]

    # Admins see everyone; others may not look.
    everyone = (await client.get("/admin/usage", headers=alice)).json()
    assert {r["username"] for r in everyone["data"]} == {"alice", "bob"}
    only_bob = (await client.get("/admin/usage", params={"username": "bob"}, headers=alice)).json()
    assert only_bob["totals"]["prompt_tokens"] == bob_usage["prompt_tokens"]
    assert (await client.get("/admin/usage", headers=bob)).status_code == 403
    assert (await client.get("/admin/usage", params={"username": "zed"}, headers=alice)).status_code == 404
    assert (await client.get("/usage", params={"days": 0}, headers=alice)).status_code == 422


async def test_feedback_on_answers(client, alice, bob):
    cid = await new_conversation(client, alice)
    _, events = await send(client, alice, cid, "Hello", max_tokens=3)
    done = done_of(events)
    url = f"/messages/{done['message_id']}/feedback"
    r = await client.post(url, headers=alice, json={"rating": "up"})
    assert r.status_code == 201 and r.json()["rating"] == "up" and r.json()["text"] is None
    r = await client.post(url, headers=alice, json={"rating": "down", "text": "made things up"})
    assert r.status_code == 201 and r.json()["rating"] == "down"
    async with client._transport.app.state.ctx.db.session() as s:  # one row per user and message
        from chatloom.store import FeedbackRows
        rows = await FeedbackRows(s).for_message(done["message_id"])
        assert [(f.rating, f.text) for f in rows] == [("down", "made things up")]
    assert (await client.post(url, headers=bob, json={"rating": "up"})).status_code == 404  # not bob's
    assert (await client.post(url, headers=alice, json={"rating": "meh"})).status_code == 422
    assert (await client.post(url, headers=alice, json={"rating": "up", "extra": 1})).status_code == 422
    r = await client.post(f"/messages/{done['user_message_id']}/feedback", headers=alice, json={"rating": "up"})
    assert r.status_code == 400
    assert (await client.post("/messages/msg_nope/feedback", headers=alice, json={"rating": "up"})).status_code == 404


async def test_metrics_parse_and_use_vllm_names(client, alice):
    cid = await new_conversation(client, alice)
    await send(client, alice, cid, "Hello", max_tokens=4)
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "chatloom:interrupted_batch_steps", "vllm:time_to_first_token_seconds",
                 "vllm:time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                 "chatloom:rate_limited", "chatloom:queue_timeouts", "chatloom:admission_queue_wait_seconds",
                 "chatloom:admission_queue_waiting", "chatloom:moderation_blocks"):
        assert name in families, name
    # The chat's steps were foreground work: the engine's step seconds say so, by kind.
    steps = {s.labels["kind"]: s.value for s in families["chatloom:engine_step_seconds"].samples
             if s.name.endswith("_total")}
    assert set(steps) == {"foreground", "background", "interrupted"} and steps["foreground"] > 0
    ttft = {s.name: s.value for s in families["vllm:time_to_first_token_seconds"].samples}
    assert ttft["vllm:time_to_first_token_seconds_count"] == 1
    assert families["vllm:prefix_cache_queries"].type == "counter"
    waits = {s.name: s.value for s in families["chatloom:admission_queue_wait_seconds"].samples}
    assert waits["chatloom:admission_queue_wait_seconds_count"] == 1


async def test_metrics_count_refusals(tmp_path):
    from traffic_testing import write_tiers
    tiers = write_tiers(tmp_path, free={"tokens_per_minute": 20})
    app = create_app(make_settings(tmp_path, traffic={"tiers_file": tiers}, server={"metrics_public": False}), ScriptedBackend())
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            root = await signup(c, "root")
            bob = await signup(c, "bob")
            body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
            assert (await c.post("/v1/chat/completions", json=body, headers=bob)).status_code == 429
            assert (await c.get("/metrics")).status_code == 401  # not public on this server
            assert (await c.get("/metrics", headers=bob)).status_code == 403
            text = (await c.get("/metrics", headers=root)).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("chatloom:rate_limited_total", (("code", "rate_limit_exceeded"),))] == 1
    assert samples[("vllm:kv_cache_usage_perc", (("model_name", "scripted"),))] == 0.25


async def test_summaries_are_metered_with_the_answer(tmp_path, tiny_backend):
    from app_testing import RecordingBackend, app_client
    settings = make_settings(tmp_path, engine={"context_window": 512}, sampling={"max_tokens": 24}, chat={"summary_max_tokens": 40})
    backend = RecordingBackend(tiny_backend)
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        answered = 0
        for i in range(10):
            _, events = await send(client, alice, cid, f"Turn {i}: tell me about the number {i * 7} in a few words.")
            usage = done_of(events)["usage"]
            answered += usage["prompt_tokens"] + usage["completion_tokens"]
            if backend.summaries():
                break
        assert backend.summaries(), "the history never outgrew the window"
        metered = (await client.get("/usage", headers=alice)).json()["totals"]["total_tokens"]
        assert metered > answered  # the summary's own tokens are in the user's usage too
