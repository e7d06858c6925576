"""The Responses API through the official `openai` package: text and message-list input, streamed and not,
function tools (a call, then its output continuing the thread via previous_response_id), json_schema output,
reasoning.effort, retrieve / delete / input_items, another user's ids, a thread continued by a second
gateway sharing the database, a backend failure mid-stream, and bad or refused requests answered with a 4xx
and nothing stored."""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import AsyncExitStack

import httpx
import jsonschema
import openai
import pydantic
import pytest
from sqlalchemy import select

from chatloom.app.main import create_app
from chatloom.app.traffic.tiers import TierTable
from chatloom.serving import BackendError
from chatloom.store import StoredResponse

from app_testing import LiveServer, make_settings, parse_sse, signup
from backing_services import create_database, drop_database, require_postgres
from traffic_testing import ScriptedBackend, write_tiers

MODEL = "tiny-random"
ROOMY = {"tokens_per_minute": 10_000_000, "tokens_per_day": 100_000_000, "requests_per_minute": 10_000,
         "max_concurrent": 50}
ADD = {"type": "function", "name": "add", "description": "Add two small numbers.", "strict": True,
       "parameters": {"type": "object",
                      "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                      "required": ["a", "b"], "additionalProperties": False}}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=120)


TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


async def new_key(http: httpx.AsyncClient, username: str) -> str:
    headers = await signup(http, username)
    r = await http.post("/auth/api-keys", headers=headers, json={"name": "sdk"})
    assert r.status_code == 201, r.text
    return r.json()["key"]


async def gateway(stack: AsyncExitStack, tmp_path, name: str, backend, db_url: str | None = None) -> httpx.AsyncClient:
    """An app over ASGI (its own SQLite file, or the database at db_url), quotas roomy, moderation off."""
    path = tmp_path / name
    path.mkdir()
    server = {"db_url": db_url} if db_url else {}
    settings = make_settings(path, server=server, traffic={"tiers_file": write_tiers(path, free=ROOMY)},
                             moderation={"mode": "off"}, sampling={"max_tokens": 16, "temperature": 0.0})
    app = create_app(settings, backend)
    await stack.enter_async_context(app.router.lifespan_context(app))
    return await stack.enter_async_context(httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                             base_url=f"http://{name}", timeout=60))


def sdk(http: httpx.AsyncClient, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key=key, http_client=http, max_retries=0)


@pytest.fixture
async def env(tmp_path, tiny_backend):
    async with AsyncExitStack() as stack:
        http = await gateway(stack, tmp_path, "gw", tiny_backend)
        alice, bob = await new_key(http, "alice"), await new_key(http, "bob")
        yield http, sdk(http, alice), sdk(http, bob), alice


def names(events) -> list[str]:
    return [e.type for e in events]


async def test_text_input_whole_and_streamed_give_the_same_answer(env):
    http, client, _, _ = env
    r = await client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL and r.store is True
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output[0].status == "incomplete" and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens

    stream = await client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0,
                                           stream=True)
    events = [e async for e in stream]
    kinds = names(events)
    assert kinds[:4] == TEXT_EVENTS and kinds[-4:] == TEXT_END + ["response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-4].text
    final = events[-1].response
    assert final.status == "incomplete" and final.output[0].content[0].text == text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if e.type == "response.output_text.delta")


async def test_message_list_input_with_instructions_and_the_stream_helper(env):
    http, client, _, _ = env
    history = [{"role": "developer", "content": "Answer in one word."},
               {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Red."}]},
               {"role": "user", "content": "Another?"}]
    whole = await client.responses.create(model=MODEL, input=history, instructions="Be brief.",
                                          max_output_tokens=6, temperature=0)
    async with client.responses.stream(model=MODEL, input=history, instructions="Be brief.", max_output_tokens=6,
                                       temperature=0) as stream:
        events = [e async for e in stream]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # cut by max_output_tokens: response.incomplete, not .completed
    assert events[-1].type == "response.incomplete" and final.output_text == text == whole.output_text
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert whole.instructions == "Be brief."
    # The instructions and every turn reached the model: a shorter thread is a shorter prompt.
    short = await client.responses.create(model=MODEL, input="Another?", max_output_tokens=1, temperature=0)
    assert whole.usage.input_tokens > short.usage.input_tokens + 10


async def test_a_function_call_then_its_output_continues_the_thread(env):
    http, client, _, _ = env
    first = await client.responses.create(model=MODEL, input="What is 2+3?", tools=[ADD],
                                          tool_choice={"type": "function", "name": "add"},
                                          parallel_tool_calls=False, max_output_tokens=150)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "add", first.output
    jsonschema.validate(json.loads(calls[0].arguments), ADD["parameters"])
    assert calls[0].call_id.startswith("call_") and first.tool_choice.name == "add"

    result = json.loads(calls[0].arguments)
    reply = await client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[ADD], tool_choice="none", max_output_tokens=4,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": str(result["a"] + result["b"])}])
    assert reply.previous_response_id == first.id and [o.type for o in reply.output] == ["message"]
    # The question, the call and its output were all in the prompt.
    alone = await client.responses.create(model=MODEL, input="What is 2+3?", tools=[ADD], tool_choice="none",
                                          max_output_tokens=4)
    assert reply.usage.input_tokens > alone.usage.input_tokens + 10

    # Streamed, a call comes as its item and its arguments' delta and done events.
    stream = await client.responses.create(model=MODEL, input="What is 2+3?", tools=[ADD], tool_choice="required",
                                           parallel_tool_calls=False, max_output_tokens=150, stream=True)
    events = [e async for e in stream]
    kinds = names(events)
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"], kinds
    done = events[4]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert done.arguments == events[3].delta == events[5].item.arguments and done.item_id == events[2].item.id
    jsonschema.validate(json.loads(done.arguments), ADD["parameters"])

    # Without previous_response_id, the client sends the thread back itself: the SDK's own output items.
    manual = await client.responses.create(
        model=MODEL, tools=[ADD], tool_choice="none", max_output_tokens=4, temperature=0, store=False,
        input=[{"role": "user", "content": "What is 2+3?"}, *[o.model_dump(exclude_none=True) for o in first.output],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": str(result["a"] + result["b"])}])
    assert manual.usage.input_tokens == reply.usage.input_tokens and manual.output_text == reply.output_text

    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model=MODEL, previous_response_id=first.id, input=[
            {"type": "function_call_output", "call_id": "call_nope", "output": "5"}])
    assert "call_nope" in e.value.message


async def test_json_schema_output_parses_and_validates(env):
    http, client, _, _ = env
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    r = await client.responses.create(model=MODEL, input="Tell me about a person.", text=fmt, max_output_tokens=60)
    assert r.status == "completed", r.output
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    stream = await client.responses.create(model=MODEL, input="Tell me about a person.", text=fmt,
                                           max_output_tokens=60, stream=True)
    events = [e async for e in stream]
    jsonschema.validate(json.loads(events[-1].response.output[0].content[0].text), PERSON)
    parsed = await client.responses.parse(model=MODEL, input="Tell me about a person.", text_format=Person,
                                          max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Person) and len(parsed.output_parsed.name) <= 6
    r = await client.responses.create(model=MODEL, input="Some JSON.", text={"format": {"type": "json_object"}},
                                      max_output_tokens=40)
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


async def test_retrieve_delete_and_input_items_pages(env):
    http, client, _, _ = env
    items = [{"role": "user", "content": f"Message {i}."} for i in range(5)]
    r = await client.responses.create(model=MODEL, input=items, max_output_tokens=3, temperature=0,
                                      metadata={"topic": "pages"})
    got = await client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    assert got.metadata == {"topic": "pages"}

    page = await client.responses.input_items.list(r.id, limit=2, order="asc")
    texts = [i.content[0].text for i in page.data]
    assert texts == ["Message 0.", "Message 1."] and page.has_more and page.last_id == page.data[-1].id
    every = [i.content[0].text async for i in client.responses.input_items.list(r.id, limit=2, order="asc")]
    assert every == [f"Message {i}." for i in range(5)]  # the SDK follows `after` page by page
    newest = await client.responses.input_items.list(r.id, limit=1)
    assert newest.data[0].content[0].text == "Message 4." and newest.has_more  # desc by default

    await client.responses.delete(r.id)
    for call in (client.responses.retrieve(r.id), client.responses.delete(r.id),
                 client.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            await call
        assert r.id in e.value.message

    # A thread whose first response was deleted goes on from the responses still there.
    one = await client.responses.create(model=MODEL, input="First.", max_output_tokens=3, temperature=0)
    two = await client.responses.create(model=MODEL, input="Second.", previous_response_id=one.id,
                                        max_output_tokens=3, temperature=0)
    three = await client.responses.create(model=MODEL, input="Third.", previous_response_id=two.id,
                                          max_output_tokens=1, temperature=0)
    await client.responses.delete(one.id)
    again = await client.responses.create(model=MODEL, input="Third.", previous_response_id=two.id,
                                          max_output_tokens=1, temperature=0)
    assert 0 < again.usage.input_tokens < three.usage.input_tokens

    # store=false: answered, never stored.
    r = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert r.store is False and r.output_text is not None
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)


async def test_another_users_response_is_a_404(env):
    http, alice, bob, _ = env
    r = await alice.responses.create(model=MODEL, input="A secret.", max_output_tokens=2)
    for call in (bob.responses.retrieve(r.id), bob.responses.delete(r.id), bob.responses.input_items.list(r.id),
                 bob.responses.create(model=MODEL, input="Go on.", previous_response_id=r.id, max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError) as e:
            await call
        assert r.id in e.value.message and e.value.body["code"] == "response_not_found"
    assert (await alice.responses.retrieve(r.id)).id == r.id  # still there for its owner
    with pytest.raises(openai.NotFoundError) as e:
        await alice.responses.create(model=MODEL, input="Go on.", previous_response_id="resp_unknown")
    assert "resp_unknown" in e.value.message and e.value.body["param"] == "previous_response_id"


async def test_reasoning_effort_maps_to_the_reasoning_class(tmp_path):
    backend = ScriptedBackend(["<think>", "Two", " and", " two", "</think>", "Four", "."])
    async with AsyncExitStack() as stack:
        http = await gateway(stack, tmp_path, "gw", backend)
        client = sdk(http, await new_key(http, "alice"))
        r = await client.responses.create(model="scripted", input="2+2?", reasoning={"effort": "minimal"})
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Four."
        assert r.output[0].content[0].text == "Two and two" and r.usage.output_tokens_details.reasoning_tokens == 3
        assert r.reasoning.effort == "minimal"
        system = backend.requests[-1].messages[0]["content"]
        assert "<think>" in system and "about 192 words" in system  # the low budget: 256 tokens
        stream = await client.responses.create(model="scripted", input="2+2?", reasoning={"effort": "high"},
                                               stream=True)
        kinds = names([e async for e in stream])
        assert kinds[2:8] == ["response.output_item.added", "response.content_part.added",
                              "response.reasoning_text.delta", "response.reasoning_text.delta",
                              "response.reasoning_text.delta", "response.reasoning_text.done"]
        assert "about 3072 words" in backend.requests[-1].messages[0]["content"]
        # A thread carries the reasoning item, but the model does not read it again.
        after = await client.responses.create(model="scripted", input="And 3+3?", previous_response_id=r.id)
        assert after.status == "completed"
        assert [m["content"] for m in backend.requests[-1].messages if m["role"] == "assistant"] == ["Four."]
        r = await client.responses.create(model="scripted", input="2+2?", reasoning={"effort": "none"})
        assert "<think>" not in json.dumps(backend.requests[-1].messages)


@pytest.fixture
def shared_db() -> str:
    url = asyncio.run(create_database(require_postgres()))
    yield url
    asyncio.run(drop_database(url))


async def test_a_second_gateway_continues_the_thread(tmp_path, tiny_backend, shared_db):
    async with AsyncExitStack() as stack:
        g1 = await gateway(stack, tmp_path, "gw1", tiny_backend, shared_db)
        g2 = await gateway(stack, tmp_path, "gw2", tiny_backend, shared_db)
        key = await new_key(g1, "alice")
        one, two = sdk(g1, key), sdk(g2, key)
        first = await one.responses.create(model=MODEL, input="Remember the word apple.", max_output_tokens=4,
                                           temperature=0)
        later = await two.responses.create(model=MODEL, input="Which word?", previous_response_id=first.id,
                                           max_output_tokens=4, temperature=0)
        alone = await two.responses.create(model=MODEL, input="Which word?", max_output_tokens=4, temperature=0)
        assert later.previous_response_id == first.id
        # The first exchange was in the prompt gateway 2 sent.
        assert later.usage.input_tokens > alone.usage.input_tokens + 5
        assert (await one.responses.retrieve(later.id)).output_text == later.output_text
        listed = await one.responses.input_items.list(later.id)
        assert [i.content[0].text for i in listed.data] == ["Which word?"]


BAD = [
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input_image"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "5"}]}, "call_1"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": "hi", "tools": [ADD], "tool_choice": {"type": "function", "name": "mul"}}, "mul"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}, "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10_000_000}, "max_tokens"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": 5}, "input"),
    ({"input": "hi", "model": "no-such-model"}, "no-such-model"),
]


@pytest.mark.parametrize("body,named", BAD, ids=[str(i) for i in range(len(BAD))])
async def test_bad_input_is_a_4xx_naming_the_problem(env, body, named):
    http, _, _, key = env
    r = await http.post("/v1/responses", headers={"Authorization": f"Bearer {key}"},
                        json={"model": MODEL, **body})
    assert 400 <= r.status_code < 500, r.text
    assert named in r.json()["error"]["message"] or named == r.json()["error"]["param"], r.text


async def test_bad_input_items_queries_are_4xx(env):
    http, client, _, key = env
    r = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    headers = {"Authorization": f"Bearer {key}"}
    for query in ("limit=0", "limit=101", "order=sideways", "after=msg_nope"):
        got = await http.get(f"/v1/responses/{r.id}/input_items?{query}", headers=headers)
        assert got.status_code == 400, (query, got.text)
    # Unauthenticated: 401, not a 404 that would tell whether the id exists.
    assert (await http.get(f"/v1/responses/{r.id}")).status_code == 401
    sse = parse_sse((await http.post("/v1/responses", headers=headers, json={
        "model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": True})).text)
    assert all(e.event == e.data["type"] for e in sse)


class FailingBackend(ScriptedBackend):
    """Sends two pieces, then fails as a lost replica does."""

    async def stream(self, request):
        sent = 0
        async for delta in super().stream(request):
            if sent == 2:
                raise BackendError("the replica went away")
            sent += 1
            yield delta


async def test_a_failure_mid_stream_ends_as_response_failed_and_is_stored_so(tmp_path):
    async with AsyncExitStack() as stack:
        http = await gateway(stack, tmp_path, "gw", FailingBackend())
        client = sdk(http, await new_key(http, "alice"))
        stream = await client.responses.create(model="scripted", input="hi", stream=True)
        events = [e async for e in stream]
        assert events[-1].type == "response.failed" and "the replica went away" in events[-1].response.error.message
        assert [e.sequence_number for e in events] == list(range(len(events)))
        message = events[-1].response.output[0]
        assert message.status == "incomplete" and message.content[0].text == "Hello there"
        stored = await client.responses.retrieve(events[-1].response.id)
        assert stored.status == "failed" and stored.output_text == "Hello there"
        with pytest.raises(openai.APIStatusError) as e:  # whole: an HTTP error, nothing stored
            await client.responses.create(model="scripted", input="hi")
        assert e.value.status_code == 502


async def test_a_refused_request_stores_nothing(tmp_path, tiny_backend):
    async with AsyncExitStack() as stack:
        http = await gateway(stack, tmp_path, "gw", tiny_backend)
        client = sdk(http, await new_key(http, "alice"))
        first = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
        app = http._transport.app
        tiers = write_tiers(tmp_path, free={**ROOMY, "tokens_per_day": 10})
        app.state.ctx.traffic.tiers = TierTable.load(tiers)
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError):
                await client.responses.create(model=MODEL, input="Go on.", previous_response_id=first.id,
                                              max_output_tokens=8, stream=stream)
        async with app.state.ctx.db.session() as session:
            rows = (await session.scalars(select(StoredResponse))).all()
        assert [r.id for r in rows] == [first.id]


class CuttableBackend(ScriptedBackend):
    """Notes the requests whose stream was closed before its end (what a departed client causes)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cut: list[str] = []

    async def stream(self, request):
        finished = False
        try:
            async for delta in super().stream(request):
                yield delta
            finished = True
        finally:
            if not finished:
                self.cut.append(request.request_id)


def test_a_client_that_leaves_mid_stream_aborts_it_and_nothing_is_stored(tmp_path):
    backend = CuttableBackend([f" w{i}" for i in range(400)], delay_s=0.01)
    settings = make_settings(tmp_path, traffic={"tiers_file": write_tiers(tmp_path, free=ROOMY)},
                             moderation={"mode": "off"}, sampling={"max_tokens": 400})
    with LiveServer(create_app(settings, backend)) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        r = http.post("/auth/signup", json={"username": "alice", "password": "correct horse"})
        headers = {"Authorization": f"Bearer {r.json()['token']}"}
        body = {"model": "scripted", "input": "hi", "stream": True}
        with http.stream("POST", "/v1/responses", headers=headers, json=body) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert first["type"] == "response.created"
            next(line for line in lines if "response.output_text.delta" in line)
        response_id = first["response"]["id"]
        deadline = time.monotonic() + 20
        while response_id not in backend.cut:  # the generation stops once the connection is gone
            assert time.monotonic() < deadline, "the backend request was not aborted"
            time.sleep(0.01)
        assert http.get(f"/v1/responses/{response_id}", headers=headers).status_code == 404
