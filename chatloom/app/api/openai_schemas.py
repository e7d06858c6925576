"""The OpenAI-compatible API's request bodies, and the ask and prompt each one becomes.

Unknown OpenAI parameters (presence_penalty, logit_bias...) are accepted and ignored, as other
compatible servers do, so existing clients keep working; parameters that would change the answer
in a way this server cannot honour (suffix, best_of > 1) are refused with a 400.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chatloom.app.core.errors import ApiError
from chatloom.app.core.image_input import ImageReader, without_markers
from chatloom.serving.images import IMAGE_MARKER
from chatloom.app.generation.pipeline import Ask, ChatPrompt, Prompt, TextPrompt, TokenPrompt
from chatloom.app.generation.tool_calls import ToolCall, ToolSpec, ToolUse, render_messages
from chatloom.app.core.validation import Seed
from chatloom.serving import Constraint, ConstraintError
from chatloom.store import User

# OpenAI's limits for top_logprobs (chat) and logprobs (completions).
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# A role:tool message longer than this is refused (a tool that dumps a whole file into the prompt).
MAX_TOOL_OUTPUT_CHARS = 32_000

LENIENT = ConfigDict(extra="ignore")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCallIn(BaseModel):
    model_config = LENIENT
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """A call an earlier assistant turn made, sent back with the conversation."""

    model_config = LENIENT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = LENIENT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers

    def text(self, images: ImageReader | None = None) -> str:
        """The content as text; with `images`, image_url parts are read into it and stand in the text
        as IMAGE_MARKER (serving/images.py). Without it, any part but text is refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return without_markers(self.content) if images is not None else self.content
        texts = []
        for part in self.content:
            if part.type == "image_url" and images is not None:
                url = getattr(part, "image_url", None)
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ApiError(400, "an image_url part needs image_url.url", "invalid_value", "messages")
                images.data_url(url)
                texts.append(IMAGE_MARKER)
                continue
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content parts of type {part.type!r} are not supported; send text"
                               + (" or image_url" if images is not None else ""), "unsupported_content", "messages")
            texts.append(without_markers(part.text) if images is not None else part.text)
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
    seed: Seed | None = None  # signed 64-bit (validation.Seed)
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
        # Left out, temperature and top_p are the service's sampling defaults (settings: [sampling]); n
        # above the service's maximum is refused by the pipeline, which knows it.
        return Ask(user=user, model=self.model, max_tokens=max_tokens, temperature=self.temperature,
                   top_p=self.top_p, seed=self.seed, stop=tuple(self.stop or ()),
                   reasoning_effort=reasoning_effort, request_id=request_id, param=param, n=self.n or 1)


class FunctionIn(BaseModel):
    model_config = LENIENT
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(BaseModel):
    model_config = LENIENT
    type: Literal["function"]
    function: FunctionIn


class NamedFunction(BaseModel):
    model_config = LENIENT
    name: str


class NamedToolChoice(BaseModel):
    model_config = LENIENT
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaIn(BaseModel):
    model_config = LENIENT
    name: str = Field(min_length=1, max_length=64)
    description: str = ""
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatIn(BaseModel):
    model_config = LENIENT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None


class ChatCompletionIn(SamplingIn):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's parameter for reasoning models: the thinking streams as delta.reasoning_content (as vLLM does).
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    tools: list[ToolIn] | None = Field(default=None, max_length=64)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormatIn | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # The server searches the web for the last user message first (api/web_search_options.py).
    web_search_options: dict[str, Any] | None = None

    def tool_use(self) -> ToolUse | None:
        """The request's tools and tool_choice, checked: 400 for an unknown name or a bad schema."""
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise ApiError(400, "tool_choice needs tools", "invalid_value", "tool_choice")
            return None
        specs = []
        for t in self.tools:
            params = t.function.parameters if t.function.parameters is not None else {"type": "object", "properties": {}}
            specs.append(ToolSpec(t.function.name, t.function.description, params))
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ApiError(400, "tool names must be unique", "invalid_value", "tools")
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ApiError(400, f"tool_choice names the function {choice.function.name!r}, which is not in "
                               f"tools ({', '.join(names)})", "invalid_value", "tool_choice")
            choice = choice.function.name
        use = ToolUse(tuple(specs), choice, self.parallel_tool_calls is not False)
        # Every schema must compile, forced or not: a bad one is the caller's error either way.
        for spec in specs:
            checked(Constraint.json_schema(spec.parameters), f"the parameters of tool {spec.name!r}", "tools")
        return use

    def constraint(self, tools: ToolUse | None) -> Constraint | None:
        """What the engine must enforce: forced tool calls, or the response_format."""
        fmt = self.response_format
        if tools is not None and tools.forced:
            if fmt is not None and fmt.type != "text":
                raise ApiError(400, "response_format cannot be combined with a forced tool_choice",
                               "invalid_value", "response_format")
            return checked(tools.constraint(), "the tools", "tools")
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint.json_object()
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(400, "response_format json_schema needs json_schema.schema", "invalid_value",
                           "response_format")
        return checked(Constraint.json_schema(fmt.json_schema.schema_), "response_format's JSON schema",
                      "response_format")

    def has_images(self) -> bool:
        return any(not isinstance(m.content, (str, type(None))) and any(p.type == "image_url" for p in m.content)
                   for m in self.messages)

    def image_urls(self) -> list[str]:
        """Every image_url part's URL, in order (for fetching the http(s) ones ahead of reading)."""
        urls = []
        for m in self.messages:
            for part in m.content if isinstance(m.content, list) else ():
                url = getattr(part, "image_url", None) if part.type == "image_url" else None
                url = url.get("url") if isinstance(url, dict) else url
                if isinstance(url, str):
                    urls.append(url)
        return urls

    def prompt(self, tools: ToolUse | None = None, images: ImageReader | None = None) -> ChatPrompt:
        """The chat prompt; with `images`, user messages may carry image_url parts (read and checked)."""
        messages: list[dict] = []
        calls_made: set[str] = set()
        for i, m in enumerate(self.messages):
            role = "system" if m.role == "developer" else m.role
            before = len(images.images) if images is not None else 0
            turn: dict = {"role": role, "content": m.text(images if role == "user" else None)}
            if images is not None and len(images.images) > before:
                turn["images"] = images.images[before:]
            if role == "assistant" and m.tool_calls:
                turn["tool_calls"] = [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
                calls_made.update(c.id for c in m.tool_calls)
            if role == "tool":
                if not m.tool_call_id or m.tool_call_id not in calls_made:
                    raise ApiError(400, f"messages[{i}] is a tool result for tool_call_id {m.tool_call_id!r}, "
                                   "which no earlier assistant message called", "invalid_value", "messages")
                if len(turn["content"]) > MAX_TOOL_OUTPUT_CHARS:
                    raise ApiError(400, f"messages[{i}]: the tool output has {len(turn['content'])} characters; "
                                   f"at most {MAX_TOOL_OUTPUT_CHARS} are accepted", "tool_output_too_large",
                                   "messages")
            messages.append(turn)
        return ChatPrompt(render_messages(messages, tools))

    @staticmethod
    def user_text(prompt: ChatPrompt) -> str:
        """What the caller wrote (not the assistant's earlier turns): the text input moderation checks."""
        return "\n".join(m["content"] for m in prompt.messages if m["role"] != "assistant")

    def to_ask(self, user: User, request_id: str, tools: ToolUse | None = None) -> Ask:
        ask = self.ask(user, request_id, "messages", self.max_completion_tokens or self.max_tokens,
                       self.reasoning_effort)
        constraint = self.constraint(tools)
        if constraint is not None and ask.reasoning_effort is not None:
            raise ApiError(400, "reasoning_effort cannot be combined with constrained output (response_format "
                           "or a forced tool_choice)", "invalid_value", "reasoning_effort")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", "invalid_value", "top_logprobs")
        return replace(ask, constraint=constraint, tools=tools,
                       logprobs=(self.top_logprobs or 0) if self.logprobs else None)


def checked(constraint: Constraint | None, what: str, param: str) -> Constraint | None:
    """A constraint that compiles, or a 400 naming what did not."""
    if constraint is None:
        return None
    try:
        constraint.check()
    except ConstraintError as exc:
        raise ApiError(400, f"{what}: {exc}", "invalid_schema", param) from None
    return constraint


class CompletionIn(SamplingIn):
    """/v1/completions: a prompt, as text or as token ids (benchmark tools send both), or a list of them;
    each prompt gets n choices, choice j of prompt i at index i * n + j."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def to_prompts(self) -> list[TextPrompt | TokenPrompt]:
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            p = [p]  # one prompt
        if not p:
            raise ApiError(400, "prompt must not be empty", "invalid_value", "prompt")
        prompts: list[TextPrompt | TokenPrompt] = []
        for i, one in enumerate(p):
            if not one:
                raise ApiError(400, f"prompt[{i}] is empty", "invalid_value", "prompt")
            if isinstance(one, str):
                prompts.append(TextPrompt(one))
            elif isinstance(one, list) and all(isinstance(t, int) for t in one):
                prompts.append(TokenPrompt(list(one)))
            else:
                raise ApiError(400, "prompt must be a string, a list of token ids, or a list of either",
                               "invalid_value", "prompt")
        return prompts

    def to_ask(self, user: User, request_id: str) -> Ask:
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "unsupported_value", "suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "only best_of=1 is supported", "unsupported_value", "best_of")
        ask = self.ask(user, request_id, "prompt", self.max_tokens)
        return replace(ask, logprobs=self.logprobs, prompt_logprobs=self.logprobs if self.echo else None)


def prompt_text(prompt: Prompt, decode) -> str:
    """The text of a completion prompt, for input moderation (token ids decoded)."""
    if isinstance(prompt, TextPrompt):
        return prompt.text
    if isinstance(prompt, TokenPrompt):
        return decode(prompt.token_ids)
    return ChatCompletionIn.user_text(prompt)
