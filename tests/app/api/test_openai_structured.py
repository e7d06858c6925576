"""response_format and function calling through the official `openai` package, against a live server
running the tiny random model: whatever the weights, the grammar makes the output parse and validate."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from chatloom.app.main import create_app

from app_testing import LiveServer, make_settings
from traffic_testing import write_tiers

MODEL = "tiny-random"
ASK = [{"role": "user", "content": "Tell me about a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "human"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 10},
                                      "unit": {"enum": ["c", "f"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
ADD = {
    "type": "function",
    "function": {"name": "add", "description": "Add two small numbers.",
                 "parameters": {"type": "object",
                                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                "required": ["a", "b"], "additionalProperties": False}},
}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_backend):
    """A server whose quotas and queue let 100 requests run together."""
    path = tmp_path_factory.mktemp("structured")
    tiers = write_tiers(path, free={"tokens_per_minute": 10_000_000, "tokens_per_day": 100_000_000,
                                    "requests_per_minute": 10_000, "max_concurrent": 200})
    settings = make_settings(path, traffic={"tiers_file": tiers, "queue_max_wait_s": 600}, moderation={"mode": "off"})
    with LiveServer(create_app(settings, tiny_backend)) as server:
        yield server


@pytest.fixture(scope="module")
def api_key(http, admin) -> str:
    return http.post("/auth/api-keys", headers=admin, json={"name": "sdk"}).json()["key"]


@pytest.fixture(scope="module")
def sdk(live, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def async_sdk(live, api_key) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=api_key, max_retries=0, timeout=300)


async def test_json_schema_output_always_parses_and_validates(async_sdk):
    """100 seeded runs at temperature 1, sent together so they share engine steps."""
    import asyncio

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def one(seed: int):
        return await async_sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=seed,
                                                       max_tokens=200, response_format=fmt)

    results = await asyncio.gather(*(one(seed) for seed in range(100)))
    texts = set()
    for r in results:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        data = json.loads(r.choices[0].message.content)
        jsonschema.validate(data, PERSON)
        texts.add(r.choices[0].message.content)
    assert len(texts) > 50  # really sampled, not one answer repeated


def test_json_object_mode(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60,
                                    response_format={"type": "json_object"})
    assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_parse_and_validate(sdk, choice):
    for seed in range(8):
        r = sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=seed, max_tokens=150,
                                        tools=[WEATHER, ADD], tool_choice=choice, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        assert len(c.message.tool_calls) == 1 and c.message.content is None
        call = c.message.tool_calls[0]
        if isinstance(choice, dict):
            assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_call(sdk):
    # Room for the random model's parallel calls to close (at 300, this seed's third call was cut: 'length').
    kw = dict(model=MODEL, messages=ASK, temperature=1.0, seed=7, max_tokens=800, tools=[WEATHER, ADD],
              tool_choice="required")
    whole = sdk.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in sdk.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = d.id or slot["id"]
            if d.function:
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert got == expected and all(c["id"] for c in calls.values())


def test_tool_round_trip(sdk):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    first = sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=200,
                                        tools=[ADD], tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    final = sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12, tools=[ADD])
    c = final.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    # The tool turn reached the model: the prompt grew by the call and the result.
    assert final.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("kwargs, param, message", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format", "Invalid type"),
    (dict(tools=[ADD], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "'nope'"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                               "properties": {"a": {"type": 7}}}}}]),
     "tools", "tool 'f'"),
])
def test_bad_structured_requests_are_clear_400s(sdk, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **kwargs)
    body = err.value.body
    assert body["param"] == param and message in body["message"], body


def test_tool_results_are_checked(sdk):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = [{"role": "user", "content": "add"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(openai.BadRequestError, match="characters"):
        sdk.chat.completions.create(model=MODEL, max_tokens=5, tools=[ADD], messages=history + [
            {"role": "tool", "tool_call_id": "call_1", "content": "x" * 40_000}])
    with pytest.raises(openai.BadRequestError, match="no earlier assistant message called"):
        sdk.chat.completions.create(model=MODEL, max_tokens=5, tools=[ADD], messages=history + [
            {"role": "tool", "tool_call_id": "call_2", "content": "3"}])


# The tiny model's tokenizer is byte-level: the shortest call block is this many tokens, plus EOS.
SHORTEST_CALL = len('<tool_call>\n{"name":"add","arguments":{"a":0,"b":0}}\n</tool_call>') + 1


def test_short_budgets_give_whole_calls_and_json_or_say_length(sdk):
    """max_tokens from 40 to 120: where the budget holds the shortest call, the steering closes the
    answer in time and it parses; where it cannot, finish_reason is "length"."""
    for n in range(40, 121, 10):
        r = sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=n, max_tokens=n,
                                        tools=[WEATHER, ADD], tool_choice="required")
        c = r.choices[0]
        if n < SHORTEST_CALL:
            assert c.finish_reason == "length" and not c.message.tool_calls, (n, c)
            assert not c.message.content.endswith("</tool_call>")  # shown as cut, not closed
            continue
        assert c.message.tool_calls, (n, c)
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert c.finish_reason == "tool_calls" or r.usage.completion_tokens == n, (n, c)
        r = sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=n, max_tokens=n,
                                        response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict), (n, r.choices[0])


def test_a_streamed_answer_too_short_for_a_call_ends_with_length(sdk):
    stream = sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=1, max_tokens=20,
                                         tools=[WEATHER, ADD], tool_choice="required", stream=True)
    chunks = [ch for ch in stream if ch.choices]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["length"]
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks)
