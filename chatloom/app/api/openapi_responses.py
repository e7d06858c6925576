"""What each route can answer, declared once, so the OpenAPI schema tells the truth.

Generated clients and contract tests trust the schema's status codes and content types
(tests/app/test_api_fuzz.py runs schemathesis against it and fails on anything undeclared).
The routes take their `responses=` from here:

- Every error answer is the JSON body `errors.ErrorOut`: {"error": {"message", "type", "param", "code"}};
  on the Anthropic Messages API, `anthropic_out.AnthropicErrorOut` ({"type": "error", "error": {...}}).
- `EDGE`, on every route (set once on the app): 400 for a bad character in the URL or the body or an
  unreadable Content-Length, and 413 for a body over `max_body_bytes`; `validation.EdgeGuard` answers
  both before any route runs.
- Request validation errors are 422 on the product API and 400 on the OpenAI-compatible /v1/ API
  (`error_handlers.install_error_handlers`); `install` rewrites FastAPI's own 422 entry, whose body the app never
  sends, to say exactly that.
- Streamed answers are text/event-stream (`sse.EventStreamResponse` as the route's response_class) and
  /metrics is Prometheus text (`PrometheusText`).
"""
from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel

from chatloom.app.api.anthropic_out import AnthropicErrorOut
from chatloom.app.api.error_handlers import is_openai_path
from chatloom.app.core.errors import ErrorOut
from chatloom.app.traffic.metrics import CONTENT_TYPE
from chatloom.app.api.schemas import AnswerEvent

Responses = dict[int | str, dict[str, Any]]

COMPONENTS = "#/components/schemas/"
ERROR_SCHEMA = {"$ref": COMPONENTS + "ErrorOut"}
ANTHROPIC_ERROR_SCHEMA = {"$ref": COMPONENTS + "AnthropicErrorOut"}

RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before trying again",
                               "schema": {"type": "integer", "minimum": 1}}}
RATE_LIMIT_HEADERS = {
    **RETRY_AFTER,
    "x-ratelimit-limit-tokens": {"description": "the tier's tokens per minute", "schema": {"type": "integer"}},
    "x-ratelimit-remaining-tokens": {"description": "tokens left this minute", "schema": {"type": "integer"}},
}

# Why each status is sent; a route lists the statuses it can send, the details are in error.message.
WHY: dict[int, str] = {
    400: "The request cannot be served as sent: a bad character (lone surrogate, control character) in the "
         "URL or the body, a body that is not JSON, an unreadable Content-Length, or a value the route "
         "refuses (error.param names it).",
    401: "No valid credential: send `Authorization: Bearer <session token or API key>`.",
    403: "Not allowed: admins only, sign-up closed, or a model the caller's tier may not use.",
    404: "Not found, or not the caller's.",
    409: "Conflicts with the current state (an answer is already being generated, a name is taken, "
         "an answer that cannot be continued).",
    413: "The request body is larger than the server's max_body_bytes (answered before parsing), or an "
         "uploaded file passes a file, storage or extraction limit.",
    415: "The uploaded file's content (not its name) is of a type the server does not read.",
    422: "The body or a parameter does not match the schema (error.param names the field).",
    429: "Over the tier's quota (tokens or requests per minute or day, concurrent answers); "
         "Retry-After says when to retry.",
    502: "The model backend failed.",
    503: "Temporarily unable: the admission queue is full or timed out, the model is loading, moderation or "
         "Redis is out of reach, or the gateway is shutting down; Retry-After says when to retry.",
    529: "Overloaded (Anthropic's overloaded_error): the admission queue is full or timed out; Retry-After says "
         "when to retry.",
}

_HEADERS: dict[int, dict] = {
    401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
    429: RATE_LIMIT_HEADERS,
    503: RETRY_AFTER,
    529: RETRY_AFTER,
}


def errors(*statuses: int, schema: dict[str, Any] = ERROR_SCHEMA) -> Responses:
    """OpenAPI `responses` for these error statuses, each with the app's JSON error body (or `schema`)."""
    out: Responses = {}
    for status in statuses:
        response: dict[str, Any] = {"description": WHY[status],
                                    "content": {"application/json": {"schema": schema}}}
        if status in _HEADERS:
            response["headers"] = _HEADERS[status]
        out[status] = response
    return out


def _sse_item(data: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.2's itemSchema, as FastAPI's own SSE routes declare it)."""
    return {"type": "object", "required": ["data"],
            "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"},
                           "retry": {"type": "integer", "minimum": 0}}}


def event_stream(description: str, data: dict[str, Any], json_model: type | None = None) -> Responses:
    """A 200 that is a server-sent event stream whose events' data is `data` (or, with `json_model`, either
    that model as JSON or the stream, as the OpenAI API answers by `stream`)."""
    response: dict[str, Any] = {"description": description,
                                "content": {"text/event-stream": {"itemSchema": _sse_item(data)}}}
    if json_model is not None:
        response["model"] = json_model
    return {200: response}


class PrometheusText(Response):
    """The Prometheus text exposition format (the schema says so for /metrics)."""

    media_type = CONTENT_TYPE


# -- the groups the routes use ---------------------------------------------------------------------------

EDGE = errors(400, 413)  # every route: validation.EdgeGuard
SIGNED_IN = errors(401)
ADMIN = errors(401, 403)
OWN_CONVERSATION = errors(401, 404)
# Starting an answer: caps, moderation, quota and admission (pipeline.py) before the stream begins.
CONVERSATION_ANSWER = errors(401, 403, 404, 409, 429, 502, 503)
OPENAI_ANSWER = errors(401, 403, 404, 429, 502, 503)
# The Anthropic Messages API: its own error body, and 529 where the other APIs send a queue's 503.
ANTHROPIC_ANSWER = errors(400, 401, 403, 404, 413, 429, 502, 503, 529, schema=ANTHROPIC_ERROR_SCHEMA)

# An answer of the conversation API: every event's data is a JSON schemas.AnswerEvent.
ANSWER_STREAM = event_stream(
    "The answer as server-sent events, each with an `id:` (resume after it with Last-Event-ID): "
    "`{\"token\"}` pieces (and `thinking`, `queue_position`, `tool_call`, `tool_result`), then "
    "`{\"done\": true, ...}`, or an `event: error` when it is refused or fails after the stream began.",
    {"type": "string", "contentMediaType": "application/json", "contentSchema": {"$ref": COMPONENTS + "AnswerEvent"}})


def anthropic_stream(json_model: type) -> Responses:
    """The Anthropic Messages API's 200: `json_model` as JSON, or with `stream: true` Anthropic's events."""
    return event_stream(
        "One JSON object; with `stream: true`, server-sent events named by their `type`: message_start, ping, "
        "content_block_start, content_block_delta (text_delta, input_json_delta), content_block_stop, "
        "message_delta (stop_reason, usage), message_stop; a failure after the stream began is an `error` event.",
        {"type": "string", "contentMediaType": "application/json"}, json_model)


def openai_stream(chunk: str, json_model: type) -> Responses:
    """The OpenAI API's 200: `json_model` as JSON, or with `stream: true` its chunks as events."""
    return event_stream(
        f"One JSON object; with `stream: true`, server-sent events of `{chunk}` chunks as JSON (a failure after "
        "the stream began is an `{\"error\": ...}` event), then the literal `data: [DONE]`.",
        {"type": "string", "description": f"a {chunk} as JSON, or [DONE]"}, json_model)


# -- the schema as a whole -------------------------------------------------------------------------------

def install(app: FastAPI) -> None:
    """Make app.openapi() add the shared error model and say what request validation errors really are."""
    generate: Callable[[], dict] = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()  # FastAPI caches it in app.openapi_schema; finished here, in place
            _add_models(schema, ErrorOut, AnthropicErrorOut, AnswerEvent)
            _validation_errors_as_sent(schema)
            _event_streams_by_event(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_models(schema: dict, *models: type[BaseModel]) -> None:
    """Models the responses above refer to by $ref (FastAPI only adds those that are response_models)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        definition = model.model_json_schema(ref_template=COMPONENTS + "{model}")
        components.update(definition.pop("$defs", {}))
        components[model.__name__] = definition


def _event_streams_by_event(schema: dict) -> None:
    """A stream is described event by event (itemSchema); FastAPI also gives a route whose response_class
    is not JSON a `schema` of one string, which next to an itemSchema would describe the whole stream."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            for response in operation.get("responses", {}).values():
                media = response.get("content", {}).get("text/event-stream", {})
                if "itemSchema" in media:
                    media.pop("schema", None)


def _validation_errors_as_sent(schema: dict) -> None:
    """FastAPI lists a 422 with its own body wherever a route has parameters; the app answers those
    errors with its error body, as 422 on the product API and 400 on /v1/ (already declared by EDGE)."""
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.get("responses", {})
            default = responses.get("422", {}).get("content", {}).get("application/json", {}).get("schema", {})
            if default.get("$ref") == COMPONENTS + "HTTPValidationError":
                if is_openai_path(path):
                    del responses["422"]
                else:
                    responses["422"] = errors(422)[422]
            operation["responses"] = dict(sorted(responses.items()))  # in order of status, for readers
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
