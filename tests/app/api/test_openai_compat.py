"""The official `openai` package against a live chatloom server, unchanged."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

MODEL = "tiny-random"
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def api_key(http, admin) -> str:
    return http.post("/auth/api-keys", headers=admin, json={"name": "sdk"}).json()["key"]


@pytest.fixture(scope="module")
def sdk(live, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=api_key, max_retries=0, timeout=30)


def test_models(sdk):
    assert [m.id for m in sdk.models.list()] == [MODEL]
    assert sdk.models.retrieve(MODEL).owned_by == "chatloom"


def test_models_say_what_they_support(sdk, live):
    served = {route.path for route in live.server.config.app.routes if hasattr(route, "path")}
    expected = {"chat": True, "completions": True, "embeddings": "/v1/embeddings" in served, "tools": True,
                "vision": False, "audio": False}
    assert [m.model_extra["capabilities"] for m in sdk.models.list()] == [expected]
    assert sdk.models.retrieve(MODEL).model_extra["capabilities"] == expected


def test_non_stream_with_usage(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0, user="u-1")
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_matches_non_stream_and_reports_usage(sdk):
    whole = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=10, temperature=0)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same answer either way
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage(sdk):
    # Greedy: sampled at the API's default temperature, the random model may end early on a stop token.
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_seed_makes_sampling_reproducible(sdk):
    def run():
        return sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=1.0, top_p=0.9,
                                           seed=1234).choices[0].message.content
    assert run() == run()


def test_session_token_works_too(live, admin):
    token = admin["Authorization"].split(" ", 1)[1]
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=token, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2


def test_errors_come_in_openai_shape(sdk, live):
    with pytest.raises(openai.NotFoundError) as e:
        sdk.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=MODEL, messages=HELLO, n=9)  # above [sampling] max_n
    assert e.value.body["param"] == "n" and "at most 8" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 3000}], max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model=MODEL, messages=HELLO, temperature=5)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=MODEL, messages=HELLO, stream=True, max_tokens=2,
                                    stop=["a", "b", "c", "d", "e"])
    assert "stop" in e.value.message
    bad = openai.OpenAI(base_url=f"{live.url}/v1", api_key="cl-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{live.url}/v1/chat/completions", content=b"{oops", headers={
        "Authorization": f"Bearer {sdk.api_key}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_content_parts_and_developer_role(sdk):
    # Greedy: a sampled random-weight model may pick its end-of-text token within three.
    r = sdk.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}])
    assert r.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=MODEL, max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert e.value.code == "unsupported_content"


def test_a_client_leaving_a_stream_aborts_the_request(sdk, http, admin):
    stream = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1500, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.time() + 10
    while http.get("/admin/stats", headers=admin).json()["backend"]["num_requests_running"]:
        assert time.time() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.05)


def test_the_stream_ends_before_its_usage_is_metered(tmp_path, tiny_backend, monkeypatch):
    """Metering writes to the database; the client's stream does not wait for it, but the user's next
    request finds the concurrency slot and the quota settled already. Here the meter blocks until the
    client has read the whole stream: a stream that waited for it would never end."""
    import threading

    from chatloom.app.traffic import metering as usage_module
    from chatloom.app.main import create_app

    from app_testing import LiveServer, make_settings

    gate = threading.Event()
    real_record = usage_module.Meter.record

    async def gated_record(self, *args, **kwargs):
        import asyncio
        await asyncio.to_thread(gate.wait, 30)
        await real_record(self, *args, **kwargs)

    monkeypatch.setattr(usage_module.Meter, "record", gated_record)
    tiers = tmp_path / "tiers.toml"
    tiers.write_text("[free]\ntokens_per_minute = 100000\ntokens_per_day = 1000000\nrequests_per_minute = 1000\n"
                     "max_concurrent = 1\nmax_tokens = 1000\n")
    settings = make_settings(tmp_path, traffic={"tiers_file": str(tiers)})
    with LiveServer(create_app(settings, tiny_backend)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        token = http.post("/auth/signup", json={"username": "meter", "password": "correct horse"}).json()["token"]
        headers = {"Authorization": f"Bearer {token}"}
        key = http.post("/auth/api-keys", headers=headers, json={"name": "sdk"}).json()["key"]
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=10)
        for _ in range(2):  # one slot: the second request is refused unless the first released it
            chunks = list(sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
            assert chunks[-1].usage.completion_tokens == 6
        assert http.get("/usage", headers=headers).json()["totals"]["total_tokens"] == 0  # not metered yet
        gate.set()
        deadline = time.time() + 20
        while http.get("/usage", headers=headers).json()["totals"]["total_tokens"] == 0:
            assert time.time() < deadline, "the usage was never metered"
            time.sleep(0.05)
