"""Property-based fuzzing of the whole HTTP API against its own OpenAPI schema (issue 12, item 7).

schemathesis reads /openapi.json from the app (in-process, over ASGI, the tiny random model behind it)
and generates requests for every operation: valid ones (positive) and ones that break the schema
(negative). Each response must pass four checks:

- not_a_server_error: no 5xx, whatever the input;
- status_code_conformance: the status is declared for the operation;
- content_type_conformance: the content type is declared for that status;
- response_schema_conformance: the body matches the declared schema.

The caller is signed in (its bearer token on most requests, so the routes behind authentication are
exercised, not only their 401), and is the server's admin (the first account). Path parameters are
often the ids of a real conversation, answer, API key and user (and body fields the served model, real
tier names), so the routes go past their 404s.
Generation is derandomized (a fixed seed) and bounded, so CI reruns the same 1,380 cases in about 20 s.

Run it alone:  CHATLOOM_RUNTIME__KERNELS=0 python -m pytest -q tests/app/api/test_api_fuzz.py -s
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup
from schemathesis.python.asgi import shutdown_lifespans
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from chatloom.app.main import create_app

from app_testing import make_settings, parse_sse
from traffic_testing import write_tiers

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Cases per operation and mode; derandomized, so the same ones every run.
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 15}
# Requests the OpenAI API can serve, and the generated fields kept on them.
WELL_FORMED = {"/v1/chat/completions": {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}]},
               "/v1/completions": {"model": "tiny-random", "prompt": "Once upon a time"},
               "/v1/messages": {"model": "tiny-random", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
               "/v1/messages/count_tokens": {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}]},
               "/v1/responses": {"model": "tiny-random", "input": "hi"},
               "/conversations/{conversation_id}/messages": {"text": "hello", "max_tokens": 8},
               "/conversations/{conversation_id}/messages/{message_id}/continue": {"max_tokens": 8},
               # A public address literal: added without any network lookup.
               "/mcp-servers": {"name": "fuzzed", "url": "https://93.184.215.14/mcp"}}
SAMPLING = {"stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
            "stop", "n", "user", "reasoning_effort", "top_k", "stop_sequences", "max_output_tokens", "instructions"}
MIN_OPERATIONS = 30  # the API has 33 operations; fewer means the schema lost routes
ROOMY = {"tokens_per_minute": 100_000_000, "tokens_per_day": 1_000_000_000, "requests_per_minute": 1_000_000,
         "max_concurrent": 100}


@dataclass
class Known:
    """Real ids for path parameters, so fuzzed requests reach past the 404s."""

    ids: dict[str, list[str]] = field(default_factory=dict)
    token: str = ""
    answers_running: Callable[[], int] = lambda: 0


@dataclass
class Tally:
    cases: int = 0
    by_operation: collections.Counter = field(default_factory=collections.Counter)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    succeeded: set[str] = field(default_factory=set)  # operations that answered 2xx at least once
    failures: list[str] = field(default_factory=list)


def _call(schema, method: str, path: str, token: str | None = None, **kwargs):
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return schema[path][method].Case(**kwargs).call(headers=headers)


def _seed(schema) -> Known:
    """The admin account, a conversation with one finished answer, an API key, a collection holding a file."""
    known = Known()
    r = _call(schema, "POST", "/auth/signup", body={"username": "fuzzer", "password": "correct horse"})
    assert r.status_code == 201, r.text
    known.token = r.json()["token"]
    deadline = time.monotonic() + 60
    while _call(schema, "GET", "/readyz").status_code != 200:  # the model loads in the background
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.1)
    cid = _call(schema, "POST", "/conversations", known.token, body={"title": "fuzz"}).json()["id"]
    r = _call(schema, "POST", "/conversations/{conversation_id}/messages", known.token,
              path_parameters={"conversation_id": cid}, body={"text": "hello", "max_tokens": 8})
    assert r.status_code == 200, r.text
    done = [e.data for e in parse_sse(r.text) if isinstance(e.data, dict) and e.data.get("done")]
    assert done, r.text
    detail = _call(schema, "GET", "/conversations/{conversation_id}", known.token,
                   path_parameters={"conversation_id": cid}).json()
    key = _call(schema, "POST", "/auth/api-keys", known.token, body={"name": "fuzz"}).json()["id"]
    response = _call(schema, "POST", "/v1/responses", known.token,
                     body={"model": "tiny-random", "input": "hello", "max_output_tokens": 8}).json()["id"]
    mcp = _call(schema, "POST", "/mcp-servers", known.token,
                body={"name": "seeded", "url": "https://93.184.215.14/mcp"}).json()["id"]
    coll = _call(schema, "POST", "/collections", known.token, body={"name": "fuzz"}).json()["id"]
    r = _call(schema, "POST", "/files", known.token, body={"file": b"Notes on fuzzing the API.", "collection_id": coll},
              media_type="multipart/form-data")
    assert r.status_code == 201, r.text
    share = _call(schema, "POST", "/conversations/{conversation_id}/shares", known.token,
                  path_parameters={"conversation_id": cid}).json()
    memory = _call(schema, "POST", "/memories", known.token, body={"text": "likes fuzzing"}).json()["id"]
    known.ids = {"conversation_id": [cid], "message_id": [m["id"] for m in detail["messages"]],
                 "file_id": [r.json()["id"]], "collection_id": [coll],
                 "key_id": [key], "response_id": [response], "server_id": [mcp], "username": ["fuzzer"],
                 "password": ["correct horse"],
                 "model_id": ["tiny-random"], "model": ["tiny-random"], "tier": ["free", "plus", "pro"],
                 "share_id": [share["id"]], "token": [share["token"]], "memory_id": [memory]}
    batches = _seed_batches(schema, known.token)
    batches["file_id"] = known.ids["file_id"] + batches["file_id"]  # the product's /files and /v1/files
    known.ids.update(batches)
    return known


def _seed_batches(schema, token: str) -> dict[str, list[str]]:
    """Files (some to fetch or delete, one kept as a batch's input) and a batch long enough to cancel."""
    line = ('{"custom_id": "c%d", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny-random", '
            '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}')
    data = "\n".join(line % i for i in range(200)).encode()
    files = []
    for _ in range(3):
        r = _call(schema, "POST", "/v1/files", token, body={"file": data, "purpose": "batch"},
                  media_type="multipart/form-data")
        assert r.status_code == 200, r.text
        files.append(r.json()["id"])
    r = _call(schema, "POST", "/v1/batches", token, body={"input_file_id": files[2], "completion_window": "24h",
                                                           "endpoint": "/v1/chat/completions"})
    assert r.status_code == 200, r.text
    batch = r.json()["id"]  # cancelled now, so cancelling it again is a 200 (an ended batch would be a 409)
    r = _call(schema, "POST", "/v1/batches/{batch_id}/cancel", token, path_parameters={"batch_id": batch})
    assert r.status_code == 200, r.text
    return {"file_id": files[:2], "input_file_id": files[2:], "batch_id": [batch], "purpose": ["batch"],
            "endpoint": ["/v1/chat/completions"], "completion_window": ["24h"]}


def _use_known_values(case, data, known: Known, mode: GenerationMode) -> None:
    """Often swap a generated value for a real one (an id, the served model, the fuzzer's name), so the
    routes get past their 404s and 401s; and for the OpenAI API, often send a well-formed request whose
    sampling parameters are the generated ones (random keys and text rarely make a servable request)."""
    if mode is GenerationMode.POSITIVE and case.path in WELL_FORMED and isinstance(case.body, dict) \
            and data.draw(st.booleans(), label="well-formed"):
        # Half of these keep the generated sampling parameters (often out of range: a 400), half send
        # the well-formed request alone, so each generating route is reached past its validation too.
        keep = data.draw(st.booleans(), label="generated sampling")
        case.body = {**WELL_FORMED[case.path], **{k: v for k, v in case.body.items() if keep and k in SAMPLING}}
    for where in (case.path_parameters, case.query, case.body):
        if not isinstance(where, dict):
            continue
        for name, values in known.ids.items():
            if name in where and data.draw(st.booleans(), label=f"real {name}"):
                where[name] = data.draw(st.sampled_from(values))


def _let_answers_finish(known: Known) -> None:
    """An answer keeps running after its stream is cut short; let it end, so the next cases on the
    conversation reach their routes rather than its 409 (an answer is already being generated)."""
    deadline = time.monotonic() + 10
    while known.answers_running() and time.monotonic() < deadline:
        time.sleep(0.005)


def _label(case) -> str:
    return f"{case.method} {case.path}"


def _fuzz_operation(operation, mode: GenerationMode, known: Known, tally: Tally) -> None:
    @settings(max_examples=EXAMPLES[mode], derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    def run(case, data) -> None:
        _use_known_values(case, data, known, mode)
        signed_in = data.draw(st.sampled_from(range(10)), label="signed in") != 5  # one in ten goes without a token
        headers = {"Authorization": f"Bearer {known.token}"} if signed_in else {}
        try:
            response = case.call(headers=headers)
        except Exception as exc:  # the app raised: the client got a 500 (Starlette re-raises it in-process)
            tally.cases += 1
            tally.failures.append(f"{_label(case)} [{mode.value}] raised {exc!r}\n  {case.as_curl_command(headers=headers)}")
            return
        tally.cases += 1
        tally.by_operation[_label(case)] += 1
        tally.statuses[response.status_code] += 1
        if 200 <= response.status_code < 300:
            tally.succeeded.add(_label(case))
            _let_answers_finish(known)
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except (AssertionError, FailureGroup) as exc:  # one failed check, or several
            tally.failures.append(f"{_label(case)} [{mode.value}] -> {response.status_code}: "
                                  f"{str(exc).strip()[:600]}\n  {case.as_curl_command(headers=headers)}")

    try:
        run()
    except Unsatisfiable:
        if mode is not GenerationMode.NEGATIVE:
            raise
        # An operation without parameters or a body has nothing to break.


NEEDS_PROVIDER = {"GET /auth/sso/login", "GET /auth/sso/callback", "POST /auth/sso/connect",
                  "DELETE /auth/sso/identities/{identity_id}"}


@pytest.fixture
def app(tmp_path):
    tiers = write_tiers(tmp_path, free=ROOMY, plus=ROOMY, pro=ROOMY)
    # max_tokens_limit keeps fuzzed answers short on the tiny model; the window leaves them room.
    # The seeded MCP server's address is public but nothing answers there for the tests: a short
    # timeout keeps each answer's attempt to list its tools from holding the answer up.
    application = create_app(make_settings(tmp_path, model={"name": "tiny-random"}, traffic={"tiers_file": tiers},
                                           sampling={"max_tokens_limit": 64},
                                           tools={"mcp_user_servers": True, "mcp_timeout_s": 0.2}))
    yield application
    shutdown_lifespans()  # the app's lifespan ran in schemathesis' event loop thread


def test_api_fuzz_finds_no_server_errors_and_no_undeclared_answers(app):
    started = time.monotonic()
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    known = _seed(schema)
    known.answers_running = app.state.ctx.conversations.running_count
    operations = [result.ok() for result in schema.get_all_operations()]
    # Deletions last, so the real ids stay valid for the other operations; among them, the deepest paths
    # first (a conversation's attached file before the conversation), then the conversation (deleting it
    # takes its shared links along), and the account itself at the end. Signing out everywhere ends the
    # fuzzer's session, so it comes after everything.
    operations.sort(key=lambda op: (op.path == "/auth/revoke-all", op.method.upper() == "DELETE", op.path == "/auth/me",
                                    op.path == "/conversations/{conversation_id}",
                                    -op.path.count("/") if op.method.upper() == "DELETE" else 0))
    tally = Tally()
    for operation in operations:
        for mode in EXAMPLES:
            _fuzz_operation(operation, mode, known, tally)

    summary = (f"{len(tally.by_operation)} operations, {tally.cases} cases in {time.monotonic() - started:.0f} s; "
               f"statuses {dict(sorted(tally.statuses.items()))}; 2xx from {len(tally.succeeded)} operations")
    print(summary)
    print("never 2xx:", sorted(set(tally.by_operation) - tally.succeeded))
    assert not tally.failures, f"{len(tally.failures)} failures ({summary}):\n" + "\n".join(tally.failures[:20])
    # Not vacuous: every operation was called, many times, and most answered 2xx at least once.
    assert len(operations) >= MIN_OPERATIONS and len(tally.by_operation) == len(operations), summary
    assert all(n >= 5 for n in tally.by_operation.values()), tally.by_operation
    assert tally.cases >= 10 * len(operations), summary
    # Single sign-on's steps need an identity provider, which this app has none of: they are still called
    # (and must answer as declared) but cannot succeed here.
    possible = [op for op in operations if f"{op.method.upper()} {op.path}" not in NEEDS_PROVIDER]
    assert len(tally.succeeded) >= 0.9 * len(possible), sorted(set(tally.by_operation) - tally.succeeded)


def test_the_schema_declares_errors_streams_and_metrics_as_sent(tmp_path):
    schema = create_app(make_settings(tmp_path, model={"name": "tiny-random"})).openapi()
    components = schema["components"]["schemas"]
    assert "HTTPValidationError" not in components and {"ErrorOut", "AnswerEvent"} <= set(components)
    paths = schema["paths"]
    error = {"$ref": "#/components/schemas/ErrorOut"}
    anthropic_error = {"$ref": "#/components/schemas/AnthropicErrorOut"}  # the Anthropic Messages API's own
    for path, operations in paths.items():
        for method, op in operations.items():
            responses = op["responses"]
            where = f"{method.upper()} {path}"
            # The edge's answers, on every route.
            assert {"400", "413"} <= set(responses), where
            for status, response in responses.items():
                if int(status) >= 400 and (path, status) != ("/readyz", "503"):  # its 503 says what is missing
                    expected = anthropic_error if path.startswith("/v1/messages") else error
                    assert response["content"]["application/json"]["schema"] == expected, (where, status)
            if path.startswith("/v1/"):
                assert "422" not in responses, where  # validation errors are 400 there
            if op.get("security"):  # the bearer scheme: a route with a caller declares its 401
                assert "401" in responses, where
    stream = paths["/conversations/{conversation_id}/messages"]["post"]["responses"]["200"]["content"]
    assert set(stream) == {"text/event-stream"}
    data = stream["text/event-stream"]["itemSchema"]["properties"]["data"]
    assert data["contentSchema"] == {"$ref": "#/components/schemas/AnswerEvent"}
    chat = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(chat) == {"application/json", "text/event-stream"}
    assert chat["application/json"]["schema"]["$ref"].endswith("/ChatCompletionOut")
    metrics = paths["/metrics"]["get"]["responses"]
    assert list(metrics["200"]["content"]) == ["text/plain; version=0.0.4; charset=utf-8"]
    assert "429" in paths["/v1/completions"]["post"]["responses"]
    assert "Retry-After" in paths["/v1/completions"]["post"]["responses"]["503"]["headers"]
    assert "204" in paths["/conversations/{conversation_id}"]["delete"]["responses"]
    messages = paths["/v1/messages"]["post"]["responses"]
    assert set(messages["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "Retry-After" in messages["529"]["headers"]
