"""The OpenAI-compatible API's request bodies, and the ask and prompt each one becomes.

Unknown OpenAI parameters (presence_penalty, logit_bias...) are accepted and ignored, as other
compatible servers do, so existing clients keep working; parameters that would change the answer
in a way this server cannot honour (n > 1, echo, several prompts) are refused with a 400.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chatloom.app.errors import ApiError
from chatloom.app.pipeline import Ask, ChatPrompt, Prompt, TextPrompt, TokenPrompt
from chatloom.store import User

LENIENT = ConfigDict(extra="ignore")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = LENIENT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content parts of type {part.type!r} are not supported; send text",
                               "unsupported_content", "messages")
            texts.append(part.text)
        return "".join(texts)


class StreamOptions(BaseModel):
    model_config = LENIENT
    include_usage: bool = False


class SamplingIn(BaseModel):
    """What both endpoints share."""

    model_config = LENIENT
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def ask(self, user: User, request_id: str, param: str, max_tokens: int | None,
            reasoning_effort: str | None = None) -> Ask:
        if self.n not in (None, 1):
            raise ApiError(400, "only n=1 is supported", "unsupported_value", "n")
        # OpenAI's defaults, not the chat product's.
        return Ask(user=user, model=self.model, max_tokens=max_tokens,
                   temperature=1.0 if self.temperature is None else self.temperature,
                   top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed, stop=tuple(self.stop or ()),
                   reasoning_effort=reasoning_effort, request_id=request_id, param=param)


class ChatCompletionIn(SamplingIn):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's parameter for reasoning models: the thinking streams as delta.reasoning_content (as vLLM does).
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def prompt(self) -> ChatPrompt:
        messages = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            if role == "tool":
                raise ApiError(400, "tool messages are not supported", "unsupported_value", "messages")
            messages.append({"role": role, "content": m.text()})
        return ChatPrompt(messages)

    @staticmethod
    def user_text(prompt: ChatPrompt) -> str:
        """What the caller wrote (not the assistant's earlier turns): the text input moderation checks."""
        return "\n".join(m["content"] for m in prompt.messages if m["role"] != "assistant")

    def to_ask(self, user: User, request_id: str) -> Ask:
        return self.ask(user, request_id, "messages", self.max_completion_tokens or self.max_tokens,
                        self.reasoning_effort)


class CompletionIn(SamplingIn):
    """/v1/completions: one prompt, as text or as token ids (benchmark tools send both)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def to_prompt(self) -> TextPrompt | TokenPrompt:
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "prompt must not be empty", "invalid_value", "prompt")
            return TextPrompt(p)
        if not p or not all(isinstance(t, int) for t in p):
            raise ApiError(400, "only one prompt per request is supported: a string or one list of token ids",
                           "unsupported_value", "prompt")
        return TokenPrompt(list(p))

    def to_ask(self, user: User, request_id: str) -> Ask:
        if self.echo:
            raise ApiError(400, "echo is not supported", "unsupported_value", "echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "unsupported_value", "suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "only best_of=1 is supported", "unsupported_value", "best_of")
        return self.ask(user, request_id, "prompt", self.max_tokens)


def prompt_text(prompt: Prompt, decode) -> str:
    """The text of a completion prompt, for input moderation (token ids decoded)."""
    if isinstance(prompt, TextPrompt):
        return prompt.text
    if isinstance(prompt, TokenPrompt):
        return decode(prompt.token_ids)
    return ChatCompletionIn.user_text(prompt)
