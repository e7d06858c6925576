"""The OpenAI-compatible API's response shapes: what /v1/chat/completions, /v1/completions and
/v1/models answer, as OpenAI's own API defines them (fields this server never fills are left out).

The routes build these answers as plain dicts, chunk by chunk; these models are what the OpenAPI
schema declares, so generated clients and the schema fuzz test (tests/app/test_api_fuzz.py) check
the dicts against them.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel

CREATED = int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # the thinking, as vLLM sends it, when reasoning_effort was set
    annotations: list[dict[str, Any]] | None = None  # url_citation, with web_search_options


FinishReason = Literal["stop", "length", "content_filter", "tool_calls"]


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobsOut(BaseModel):
    """With `logprobs: true`: one entry per answer token, with `top_logprobs` alternatives each."""

    content: list[TokenLogprobOut] | None
    refusal: None = None


class CompletionLogprobsOut(BaseModel):
    """With `logprobs: k`: per token its text, logprob, the k likeliest tokens and the chosen one, and where it
    starts in the choice's text; None for an echoed prompt's first token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoiceOut(BaseModel):
    index: int
    message: AssistantMessageOut
    finish_reason: FinishReason
    logprobs: ChatLogprobsOut | None = None


class ChatCompletionOut(BaseModel):
    """A whole chat answer (`stream: false`); with `stream: true` the same fields arrive as
    chat.completion.chunk events, then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[ChatChoiceOut]
    usage: UsageOut


class CompletionChoiceOut(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobsOut | None = None


class CompletionOut(BaseModel):
    """A whole text completion (`stream: false`); streamed, the same as text_completion events."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[CompletionChoiceOut]
    usage: UsageOut


class CapabilitiesOut(BaseModel):
    """What a model can be asked for here (an extension: OpenAI's model object has no such field)."""

    chat: bool  # /v1/chat/completions, /v1/messages, the conversations API
    completions: bool  # /v1/completions
    embeddings: bool  # /v1/embeddings
    tools: bool  # function calling / tool use
    vision: bool  # images in the input
    audio: bool = False  # speech in: the model behind /v1/audio/transcriptions


class ModelOut(BaseModel):
    id: str
    object: str = "model"
    created: int = CREATED
    owned_by: str = "chatloom"
    capabilities: CapabilitiesOut | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelOut]
