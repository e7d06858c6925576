"""Validation at the edge (chatloom/app/core/validation.py): every case the adversarial report listed is a
4xx naming the problem, on both APIs, and degenerate sampling values harm no other user's stream."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from chatloom.engine import EngineConfig
from chatloom.serving import LocalBackend

from app_testing import app_client, make_settings, new_conversation, parse_sse, signup
from traffic_testing import write_tiers

MODEL = "tiny-random"


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def raw_json(obj) -> bytes:
    """JSON with lone surrogates kept as \\uXXXX escapes (json.dumps' default), as a client would send them."""
    return json.dumps(obj).encode()


BAD_TEXTS = [("hi \ud800 there", "lone surrogate"), ("a\udfffb", "lone surrogate"),
             ("nul \x00 byte", "control character"), ("esc \x1b[31m", "control character")]


@pytest.mark.parametrize("text,words", BAD_TEXTS, ids=["high", "low", "nul", "esc"])
async def test_bad_characters_are_400_naming_the_field_on_both_apis(client, alice, text, words):
    cid = await new_conversation(client, alice)
    headers = {**alice, "content-type": "application/json"}
    r = await client.post(f"/conversations/{cid}/messages", headers=headers, content=raw_json({"text": text}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "text" and err["code"] == "invalid_text" and words in err["message"]
    r = await client.post("/v1/chat/completions", headers=headers,
                          content=raw_json({"model": MODEL, "messages": [{"role": "system", "content": "ok"},
                                                                         {"role": "user", "content": text}]}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[1].content" and words in r.json()["error"]["message"]


async def test_tabs_and_newlines_are_fine(client, alice):
    r = await client.post("/v1/chat/completions", headers=alice, json=chat("a\tb\r\nc\n"))
    assert r.status_code == 200, r.text


async def test_control_characters_in_the_url_are_400(client, alice):
    r = await client.get("/conversations/%00", headers=alice)
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    r = await client.get("/conversations?leaf=%01", headers=alice)
    assert r.status_code == 400 and r.json()["error"]["param"] == "leaf"


@pytest.mark.parametrize("query,status", [("offset=9223372036854775808", 422), ("offset=99999999999999999999999", 422),
                                          ("offset=9223372036854775807", 200), ("limit=9223372036854775808", 422)])
async def test_pagination_bounds(client, alice, query, status):
    r = await client.get(f"/conversations?{query}", headers=alice)
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json() == []
    else:
        assert r.json()["error"]["param"] in ("offset", "limit")


@pytest.mark.parametrize("seed,status", [(2 ** 64, 400), (2 ** 63, 400), (-(2 ** 63) - 1, 400),
                                         (2 ** 63 - 1, 200), (-(2 ** 63), 200)])
async def test_seed_range_on_the_openai_api(client, alice, seed, status):
    r = await client.post("/v1/chat/completions", headers=alice, json=chat("hi", seed=seed, temperature=1))
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "seed"


async def test_body_size_limit_is_413_before_parsing(tmp_path, tiny_backend):
    async with app_client(make_settings(tmp_path, server={"max_body_bytes": 10_000}), tiny_backend) as (client, app, alice):
        r = await client.post("/v1/chat/completions", headers=alice, json=chat("x" * 20_000))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "10000" in r.json()["error"]["message"]

        async def chunked():  # no Content-Length: the guard counts the bytes as they arrive
            yield b'{"model": "tiny-random", "messages": [{"role": "user", "content": "'
            for _ in range(30):
                yield b"y" * 1000
            yield b'"}]}'

        r = await client.post("/v1/chat/completions", headers={**alice, "content-type": "application/json"},
                              content=chunked())
        assert r.status_code == 413
        # Not even the JSON is looked at: a broken body over the limit is still a 413.
        r = await client.post("/v1/chat/completions", headers={**alice, "content-type": "application/json"},
                              content=b"{" * 20_000)
        assert r.status_code == 413
        r = await client.post("/v1/chat/completions", headers=alice, json=chat("small"))
        assert r.status_code == 200


async def test_impossible_requests_are_400_on_both_apis_never_429_or_503(tmp_path, tiny_model_fp32):
    # A pool of 8 blocks x 16 = 128 tokens, a 512-token window, and a tight per-minute quota.
    backend = LocalBackend(tiny_model_fp32, engine_config=EngineConfig(num_blocks=8, block_size=16,
                                                                       max_model_len=512))
    await backend.start()
    try:
        tiers = write_tiers(tmp_path, free={"tokens_per_minute": 100})
        settings = make_settings(tmp_path, traffic={"tiers_file": tiers, "queue_max_wait_s": 5})
        async with app_client(settings, backend) as (client, app, alice):
            t0 = time.monotonic()
            # Longer than the context window: 400, not the quota's 429.
            r = await client.post("/v1/chat/completions", headers=alice, json=chat("z" * 600, max_tokens=1))
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            # Fits the window but never the KV pool: 400 at once, not a queue wait ending in 503.
            # (The local backend's window already counts the pool: 128 tokens here.)
            r = await client.post("/v1/chat/completions", headers=alice, json=chat("z" * 200, max_tokens=1))
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            cid = await new_conversation(client, alice)
            r = await client.post(f"/conversations/{cid}/messages", headers=alice,
                                  json={"text": "z" * 150, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert time.monotonic() - t0 < 3
    finally:
        await backend.close()


async def test_large_input_is_tokenized_off_the_event_loop(tmp_path, tiny_backend, monkeypatch):
    """/healthz keeps answering while a 900 KB message is tokenized: the count runs in a worker thread and
    the tokenizer lets the interpreter lock go. Checked by how many answers came while it ran, not by how
    long any one took (a collection or a busy machine can pause a process whatever it runs)."""
    encoding: list[float] = []  # when the message's tokenizing began and ended, in its worker thread
    tokenizer = tiny_backend.tokenizer
    real_encode = tokenizer.encode

    def timed_encode(text: str, *args, **kwargs):
        if len(text) < 100_000:
            return real_encode(text, *args, **kwargs)
        encoding.append(time.monotonic())
        try:
            return real_encode(text, *args, **kwargs)
        finally:
            encoding.append(time.monotonic())

    monkeypatch.setattr(tokenizer, "encode", timed_encode)
    async with app_client(make_settings(tmp_path, moderation={"mode": "lexicon"}), tiny_backend) as (client, app, alice):
        big = chat("w" * 900_000)
        answered: list[float] = []
        done = asyncio.Event()

        async def probe():
            while not done.is_set():
                r = await client.get("/healthz")
                assert r.status_code == 200
                answered.append(time.monotonic())
                await asyncio.sleep(0.01)

        prober = asyncio.create_task(probe())
        r = await client.post("/v1/chat/completions", headers=alice, json=big)
        done.set()
        await prober
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # Tokenized once (the backend caches a prompt's token ids between the gateway's count and the
        # generation), in 0.5 s here: about 50 answers. Holding the lock or the loop leaves 0-2, from the
        # edges of the window.
        began, ended = encoding[0], encoding[-1]
        assert len(encoding) == 2 and ended - began > 0.1
        during = [t for t in answered if began < t < ended]
        assert len(during) >= 10, (len(during), ended - began)


BAD_SAMPLING = [{"temperature": 1e-40}, {"temperature": 1e-320}, {"top_p": 1e-320},
                {"temperature": 5e-324, "top_p": 5e-324}]


async def test_a_bystanders_stream_survives_every_bad_sampling_value(client, alice):
    cid = await new_conversation(client, alice)

    async def bystander():
        r = await client.post(f"/conversations/{cid}/messages", headers=alice,
                              json={"text": "tell me a long story", "max_tokens": 40, "temperature": 0.8})
        return r, parse_sse(r.text)

    async def bad(user, values):  # each from its own account (a tier caps concurrent generations)
        return await client.post("/v1/chat/completions", headers=user,
                                 json=chat("hi", max_tokens=8, stream=True, **values))

    users = [await signup(client, f"mallory{i}") for i in range(len(BAD_SAMPLING))]
    results = await asyncio.gather(bystander(), *(bad(u, v) for u, v in zip(users, BAD_SAMPLING)))
    r, events = results[0]
    assert r.status_code == 200
    done = [e.data for e in events if isinstance(e.data, dict) and e.data.get("done")]
    assert done and done[0]["status"] in ("complete", "incomplete"), events
    # Sampled at 0.8, the tiny model may end with EOS at once: an answer of one token is still an answer.
    assert done[0]["usage"]["completion_tokens"] >= 1 and not any(e.event == "error" for e in events)
    for resp in results[1:]:
        assert resp.status_code == 200, resp.text
        assert "generation_failed" not in resp.text and resp.text.rstrip().endswith("data: [DONE]")
