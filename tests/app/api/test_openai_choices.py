"""n > 1 and lists of prompts on the OpenAI-compatible API, with the official `openai` package: each
choice its own index, text and finish reason; one prefill for all of a prompt's choices; the quota
reserves for every choice."""
from __future__ import annotations

import httpx
import openai
import pytest

from chatloom.app.main import create_app

from app_testing import LiveServer, make_settings

MODEL = "tiny-random"
HELLO = [{"role": "user", "content": "Tell me a story about a dragon."}]


@pytest.fixture(scope="module")
def sdk(live, http, admin) -> openai.OpenAI:
    key = http.post("/auth/api-keys", headers=admin, json={"name": "sdk"}).json()["key"]
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=30)


def _texts(r) -> list[str]:
    return [c.message.content if hasattr(c, "message") else c.text for c in sorted(r.choices, key=lambda c: c.index)]


def test_n_choices_with_a_seed_are_reproducible_and_differ(sdk):
    def run():
        return sdk.chat.completions.create(model=MODEL, messages=HELLO, n=3, max_tokens=12, temperature=1.0,
                                           seed=77)
    r = run()
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len(set(_texts(r))) == 3  # each choice draws from its own random stream
    assert _texts(run()) == _texts(r)
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    # The prompt is counted once, the answers of every choice added up.
    one = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=1.0, seed=77)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert _texts(one)[0] == _texts(r)[0]  # choice 0 draws from the request's own seed


def test_n_choices_share_one_prefill(sdk, tiny_backend):
    before = tiny_backend.stats()
    messages = [{"role": "user", "content": "A prompt long enough to fill more than one block of sixteen tokens "
                                            "of the key-value cache, so that sharing shows."}]
    r = sdk.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=6, temperature=1.0,
                                    seed=5)
    after = tiny_backend.stats()
    assert len(r.choices) == 3 and r.usage.prompt_tokens > 16
    # The prompt went through the prefix cache (and the model) once, not once per choice.
    assert after.prefix_cache_queries - before.prefix_cache_queries == r.usage.prompt_tokens - 1
    assert after.kv_cache_free_blocks == before.kv_cache_free_blocks  # every choice's blocks given back


def test_n_choices_streamed(sdk):
    whole = sdk.chat.completions.create(model=MODEL, messages=HELLO, n=2, max_tokens=8, temperature=1.0, seed=3)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=HELLO, n=2, max_tokens=8, temperature=1.0,
                                              seed=3, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [texts[0], texts[1]] == _texts(whole)
    assert sorted(finishes) == [0, 1]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_list_of_prompts_each_with_n_choices(sdk):
    prompts = ["The sky is", "Rivers flow to"]
    r = sdk.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt_index * n + choice
    for i, prompt in enumerate(prompts):
        alone = sdk.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=5, temperature=1.0, seed=11)
        assert _texts(r)[2 * i:2 * i + 2] == _texts(alone)
    ids = sdk.completions.create(model=MODEL, prompt=[[40, 41, 42], [50, 51]], max_tokens=3, temperature=0)
    assert [c.index for c in ids.choices] == [0, 1]
    assert ids.usage.prompt_tokens == 5
    chunks = list(sdk.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=1.0, seed=11,
                                         stream=True))
    streamed = {i: "" for i in range(4)}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.text
    assert [streamed[i] for i in range(4)] == _texts(r)


def test_n_above_the_limit_is_refused(sdk):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=MODEL, prompt="hi", n=9)
    assert e.value.body["param"] == "n" and "n may be at most 8" in e.value.message


def test_the_quota_reserves_for_every_choice(tmp_path, tiny_backend):
    tiers = tmp_path / "tiers.toml"
    tiers.write_text("[free]\ntokens_per_minute = 120\ntokens_per_day = 100000\nrequests_per_minute = 1000\n"
                     "max_concurrent = 4\nmax_tokens = 1000\n")
    settings = make_settings(tmp_path, traffic={"tiers_file": str(tiers)}, sampling={"max_n": 4})
    with LiveServer(create_app(settings, tiny_backend)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        token = http.post("/auth/signup", json={"username": "quota", "password": "correct horse"}).json()["token"]
        headers = {"Authorization": f"Bearer {token}"}
        key = http.post("/auth/api-keys", headers=headers, json={"name": "sdk"}).json()["key"]
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=10)
        prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 10 tokens, and up to 40 of answer per choice
        with pytest.raises(openai.RateLimitError):  # 10 + 3 * 40 = 130 > 120 (one choice would be 50)
            sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=40, n=3, temperature=0)
        ok = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=40, n=2, temperature=0)  # 90 fits
        assert len(ok.choices) == 2
        with pytest.raises(openai.BadRequestError) as e:
            sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=5)
        assert "at most 4" in e.value.message


def test_a_refused_prompt_in_a_list_leaves_nothing_started(live, http, tiny_backend):
    token = http.post("/auth/signup", json={"username": "lister", "password": "correct horse"}).json()["token"]
    headers = {"Authorization": f"Bearer {token}"}
    key = http.post("/auth/api-keys", headers=headers, json={"name": "sdk"}).json()["key"]
    sdk = openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=MODEL, prompt=["A fine first prompt", "word " * 3000], max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    usage = http.get("/usage", headers=headers).json()
    assert usage["remaining_tokens_this_minute"] == usage["limits"]["tokens_per_minute"]  # nothing reserved
    assert usage["totals"]["total_tokens"] == 0
    assert tiny_backend.stats().num_requests_running == 0
