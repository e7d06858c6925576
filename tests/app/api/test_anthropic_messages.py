"""The official `anthropic` package against a live chatloom server: /v1/messages (streamed and not),
tools, stop sequences, count_tokens, and errors in Anthropic's shape (401, 400, 404, 429, 529, a stream's
error event)."""
from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import jsonschema
import pytest

from chatloom.app.main import create_app
from chatloom.serving import BackendError

from app_testing import LiveServer, make_settings, merge_groups, parse_sse
from traffic_testing import ScriptedBackend, write_tiers

MODEL = "tiny-random"
# Sampling settings are not arguments of the SDK's create() (recent models fix them); the API takes them.
GREEDY = {"temperature": 0}
HELLO = [{"role": "user", "content": "Say hello."}]
ADD = {"name": "add", "description": "Add two small numbers.",
       "input_schema": {"type": "object",
                        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                       "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                        "required": ["a", "b"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_backend):
    path = tmp_path_factory.mktemp("anthropic")
    tiers = write_tiers(path, free={"tokens_per_minute": 10_000_000, "tokens_per_day": 100_000_000,
                                    "requests_per_minute": 10_000, "max_concurrent": 50})
    settings = make_settings(path, traffic={"tiers_file": tiers}, moderation={"mode": "lexicon"})
    with LiveServer(create_app(settings, tiny_backend)) as server:
        yield server


def new_key(url: str, username: str = "claude") -> str:
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/auth/signup", json={"username": username, "password": "correct horse"})
        assert r.status_code == 201, r.text
        headers = {"Authorization": f"Bearer {r.json()['token']}"}
        return http.post("/auth/api-keys", headers=headers, json={"name": "sdk"}).json()["key"]


@pytest.fixture(scope="module")
def api_key(live) -> str:
    return new_key(live.url)


@pytest.fixture(scope="module")
def client(live, api_key) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key=api_key, max_retries=0, timeout=30)


def test_a_whole_message(client):
    m = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system="Be brief.", messages=HELLO)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 8
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=HELLO).input_tokens
    # Anthropic's input_tokens leaves out the tokens read from the prefix cache.
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted > 0


def test_a_stream_has_anthropics_events_and_the_same_answer(client, live, api_key):
    whole = client.messages.create(model=MODEL, max_tokens=10, extra_body=GREEDY, messages=HELLO)
    with client.messages.stream(model=MODEL, max_tokens=10, extra_body=GREEDY, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens

    r = httpx.post(f"{live.url}/v1/messages", headers={"x-api-key": api_key}, timeout=30, json={
        "model": MODEL, "max_tokens": 4, "temperature": 0, "messages": HELLO, "stream": True})
    events = parse_sse(r.text)
    names = [e.event for e in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[2] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(e.data["type"] == e.event for e in events)
    start = events[0].data["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert all(e.data["delta"]["type"] == "text_delta" for e in events[3:-3])
    delta = events[-2].data
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4


def test_stop_sequences_end_the_answer_and_are_named(client):
    text = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=HELLO).content[0].text
    # Two printable characters from the middle of the greedy answer (the random model writes control characters
    # too, which the API refuses in a request).
    at = next(i for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].isprintable())
    stop = text[at:at + 2]
    kept = text[:text.find(stop)]
    m = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=HELLO, stop_sequences=[stop, "never said"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert "".join(b.text for b in m.content) == kept
    with client.messages.stream(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=HELLO,
                                stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_a_tool_use_round_trip(client):
    m = client.messages.create(model=MODEL, max_tokens=150, messages=[{"role": "user", "content": "What is 2+3?"}],
                               tools=[ADD], tool_choice={"type": "tool", "name": "add",
                                                         "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use", m.content
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "add"
    jsonschema.validate(calls[0].input, ADD["input_schema"])
    history = [{"role": "user", "content": "What is 2+3?"},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                             "content": str(calls[0].input["a"] + calls[0].input["b"])}]}]
    none = {"type": "none"}
    reply = client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=history, tools=[ADD],
                                   tool_choice=none)
    assert reply.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in reply.content)
    # The call and its result reached the model: the prompt grew by them.
    sent = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert sent == client.messages.count_tokens(model=MODEL, messages=history, tools=[ADD],
                                                tool_choice=none).input_tokens
    question = client.messages.count_tokens(model=MODEL, messages=history[:1], tools=[ADD], tool_choice=none)
    assert sent > question.input_tokens + 10

    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=6, messages=[
            history[0], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope",
                                                      "content": "5"}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "toolu_nope" in e.value.message


def test_a_streamed_tool_call_arrives_as_input_json(client):
    with client.messages.stream(model=MODEL, max_tokens=150, messages=[{"role": "user", "content": "2+3?"}],
                                tools=[ADD], tool_choice={"type": "any", "disable_parallel_tool_use": True}) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
    assert ("content_block_delta", "input_json_delta") in kinds
    call = [b for b in final.content if b.type == "tool_use"][0]
    jsonschema.validate(call.input, ADD["input_schema"])


def test_errors_come_in_anthropics_shape(client, live, api_key):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=HELLO)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=HELLO, extra_body={"temperature": 1.5})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "temperature" in e.value.message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    # max_tokens is required, as Anthropic requires it; a body that is not JSON is a 400 too.
    for content in (json.dumps({"model": MODEL, "messages": HELLO}), "{oops"):
        r = httpx.post(f"{live.url}/v1/messages", content=content,
                       headers={"x-api-key": api_key, "content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"] or "JSON" in r.json()["error"]["message"]
    # Moderation refuses before any model work, in the same shape.
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "I will kill you"}])
    assert "moderation" in e.value.message


def test_keys_in_x_api_key_or_bearer_and_nothing_without(client, live, api_key):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=live.url, api_key="cl-wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{live.url}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": HELLO})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=live.url, auth_token=api_key, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=HELLO).usage.output_tokens == 2


# -- traffic control, with a scripted backend -------------------------------------------------------------

def scripted_server(tmp_path, backend, **settings):
    tiers = write_tiers(tmp_path, **settings.pop("tiers", {"free": {"max_concurrent": 50}}))
    return LiveServer(create_app(make_settings(tmp_path, **merge_groups(
        {"traffic": {"tiers_file": tiers}, "moderation": {"mode": "off"}}, settings)), backend))


def test_a_queue_that_refuses_is_a_529_overloaded_error(tmp_path):
    backend = ScriptedBackend(["a"] * 200, delay_s=0.02)
    with scripted_server(tmp_path, backend, traffic={"admission_max_running": 1, "queue_max_wait_s": 0.2}) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key=new_key(server.url), max_retries=0, timeout=30)
        body = dict(model="scripted", messages=HELLO)
        busy = threading.Thread(target=lambda: client.messages.create(max_tokens=200, **body))
        busy.start()
        deadline = time.time() + 10
        while backend.running == 0:
            assert time.time() < deadline, "the first request never started"
            time.sleep(0.01)
        with pytest.raises(anthropic.OverloadedError) as e:
            client.messages.create(max_tokens=3, **body)
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
        assert int(e.value.response.headers["retry-after"]) >= 1
        busy.join(30)
        assert len(backend.requests) == 1  # the refused request cost no model work


def test_over_the_quota_is_a_429_with_retry_after(tmp_path):
    backend = ScriptedBackend(["ok"])
    tiers = {"free": {"tokens_per_minute": 60, "tokens_per_day": 1000}}
    with scripted_server(tmp_path, backend, tiers=tiers) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key=new_key(server.url), max_retries=0, timeout=30)
        client.messages.create(model="scripted", max_tokens=40, messages=HELLO)
        with pytest.raises(anthropic.RateLimitError) as e:  # what the first used plus this one's budget: over 60
            client.messages.create(model="scripted", max_tokens=55, messages=HELLO)
        assert e.value.body["error"]["type"] == "rate_limit_error"
        assert 1 <= int(e.value.response.headers["retry-after"]) <= 60


class FailingBackend(ScriptedBackend):
    """Sends two pieces, then the backend fails."""

    async def stream(self, request):
        async for delta in super().stream(request):
            if delta.completion_tokens == 3:
                raise BackendError("the replica went away")
            yield delta


def test_a_stream_that_fails_half_way_ends_with_an_error_event(tmp_path):
    with scripted_server(tmp_path, FailingBackend()) as server:
        key = new_key(server.url)
        r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": key}, timeout=30, json={
            "model": "scripted", "max_tokens": 10, "messages": HELLO, "stream": True})
        events = parse_sse(r.text)
        assert [e.event for e in events][:2] == ["message_start", "ping"]
        assert "content_block_delta" in [e.event for e in events]
        assert events[-1].event == "error" and events[-1].data["type"] == "error"
        assert events[-1].data["error"]["type"] == "api_error" and "replica" in events[-1].data["error"]["message"]
        assert "message_stop" not in [e.event for e in events]
        client = anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=30)
        with pytest.raises(anthropic.APIStatusError) as e:
            with client.messages.stream(model="scripted", max_tokens=10, messages=HELLO) as stream:
                for _ in stream:
                    pass
        assert e.value.body["error"]["type"] == "api_error"
