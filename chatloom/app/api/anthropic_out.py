"""The Anthropic Messages API's response shapes, as Anthropic's API defines them (fields this server never
fills are left out). The route builds its answers as plain dicts, event by event; these models are what
the OpenAPI schema declares."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal",
                     "model_context_window_exceeded"]


class TextBlockOut(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlockOut(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageUsageOut(BaseModel):
    """input_tokens leaves out the prompt tokens read from the prefix cache (cache_read_input_tokens), as
    Anthropic counts them: the prompt's size is their sum."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class AnthropicMessageOut(BaseModel):
    """A whole answer (`stream: false`); streamed, the same arrives as Anthropic's events
    (message_start, content_block_start/delta/stop, message_delta, message_stop, ping, error)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextBlockOut | ToolUseBlockOut]
    stop_reason: StopReason
    stop_sequence: str | None
    usage: MessageUsageOut


class CountTokensOut(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, ..., overloaded_error, api_error
    message: str


class AnthropicErrorOut(BaseModel):
    """The body of every error answer of this API, and the data of a stream's `error` event."""

    type: Literal["error"]
    error: AnthropicErrorDetail
