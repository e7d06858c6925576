"""The Responses API's answer shapes, as OpenAI defines them: the response object, a deleted response and
a page of input items. The route builds plain dicts (app/responses/writer.py); these models are what the
OpenAPI schema declares. Items stay loose objects: their shape depends on their `type`."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsageOut(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseOut(BaseModel):
    """A response: its output items (message, function_call, reasoning), status and usage, with the request's
    settings echoed. Streamed, the same object arrives in response.created/in_progress (no output yet) and
    in the last event (response.completed, response.incomplete or response.failed)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    background: bool
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    instructions: str | None
    model: str
    output: list[dict[str, Any]]
    previous_response_id: str | None
    usage: ResponseUsageOut | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: str
    user: str | None


class ResponseDeletedOut(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class InputItemListOut(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
