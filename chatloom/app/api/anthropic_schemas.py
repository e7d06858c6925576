"""The Anthropic Messages API's request bodies (/v1/messages, /v1/messages/count_tokens), and the ask and
prompt each one becomes.

Content blocks are turned into the turns the OpenAI front produces, so both go through the same prompt
rendering (app/generation/tool_calls.py): `system` joins the system turn, an assistant turn's `tool_use`
blocks become its tool calls, a user turn's `tool_result` blocks become `role: tool` turns (each must answer
a `tool_use` id of an earlier assistant turn). A conversation that ends with an assistant turn is continued
from its text (Anthropic's "prefill"). Unknown fields (metadata, cache_control...) are accepted and ignored;
block types this server cannot read (documents, thinking) are refused with a 400 naming them. A user turn's
`image` blocks (base64 sources) reach a model that reads images, as on the OpenAI front.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chatloom.app.core.errors import ApiError
from chatloom.app.core.image_input import ImageReader, without_markers
from chatloom.serving.images import IMAGE_MARKER
from chatloom.app.generation.pipeline import Ask, ChatPrompt
from chatloom.app.generation.tool_calls import ToolCall, ToolSpec, ToolUse, render_messages
from chatloom.app.api.openai_schemas import MAX_TOOL_OUTPUT_CHARS, checked
from chatloom.serving import Constraint
from chatloom.store import User

LENIENT = ConfigDict(extra="ignore")
MAX_STOP_SEQUENCES = 16


class TextBlockIn(BaseModel):
    model_config = LENIENT
    type: Literal["text"]
    text: str


class ToolUseBlockIn(BaseModel):
    """A call an earlier assistant turn made, sent back with the conversation."""

    model_config = LENIENT
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlockIn(BaseModel):
    """What a tool answered to a call: text, or text blocks."""

    model_config = LENIENT
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlockIn] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body


class ImageSourceIn(BaseModel):
    model_config = LENIENT
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlockIn(BaseModel):
    model_config = LENIENT
    type: Literal["image"]
    source: ImageSourceIn


ContentBlockIn = Annotated[Union[TextBlockIn, ToolUseBlockIn, ToolResultBlockIn, ImageBlockIn],
                           Field(discriminator="type")]


class AnthropicMessageIn(BaseModel):
    model_config = LENIENT
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockIn]

    def blocks(self) -> list[TextBlockIn | ToolUseBlockIn | ToolResultBlockIn | ImageBlockIn]:
        return [TextBlockIn(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class AnthropicToolIn(BaseModel):
    """A client tool: its name, what it does, and its input's JSON schema."""

    model_config = LENIENT
    type: Literal["custom"] | None = None  # server tools (web search...) are refused by the discriminator
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str = ""
    input_schema: dict[str, Any]


class ToolChoiceIn(BaseModel):
    model_config = LENIENT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with type "tool"
    disable_parallel_tool_use: bool | None = None


class MessagesBase(BaseModel):
    """What /v1/messages and /v1/messages/count_tokens share: the conversation and the tools."""

    model_config = LENIENT
    model: str = Field(min_length=1)
    messages: list[AnthropicMessageIn] = Field(min_length=1)
    system: str | list[TextBlockIn] | None = None
    tools: list[AnthropicToolIn] | None = Field(default=None, max_length=64)
    tool_choice: ToolChoiceIn | None = None

    def tool_use(self) -> ToolUse | None:
        """The tools and tool_choice, checked: 400 for an unknown name or a schema that does not compile."""
        choice = self.tool_choice
        if not self.tools:
            if choice is not None and choice.type in ("any", "tool"):
                raise ApiError(400, f"tool_choice {choice.type!r} needs tools", "invalid_value", "tool_choice")
            return None
        specs = [ToolSpec(t.name, t.description, t.input_schema) for t in self.tools]
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ApiError(400, "tool names must be unique", "invalid_value", "tools")
        mode: str = "auto"
        if choice is not None:
            mode = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, choice.name or "")
            if choice.type == "tool" and choice.name not in names:
                raise ApiError(400, f"tool_choice names the tool {choice.name!r}, which is not in tools "
                               f"({', '.join(names)})", "invalid_value", "tool_choice")
        parallel = not (choice is not None and choice.disable_parallel_tool_use)
        for spec in specs:
            checked(Constraint.json_schema(spec.parameters), f"the input_schema of tool {spec.name!r}", "tools")
        return ToolUse(tuple(specs), mode, parallel)

    def system_text(self) -> str:
        if self.system is None:
            return ""
        return self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)

    def has_images(self) -> bool:
        return any(isinstance(b, ImageBlockIn) for m in self.messages for b in m.blocks())

    def image_urls(self) -> list[str]:
        """Every url-source image block's URL, in order (for fetching ahead of reading)."""
        return [b.source.url for m in self.messages for b in m.blocks()
                if isinstance(b, ImageBlockIn) and b.source.type == "url" and b.source.url]

    def prompt(self, tools: ToolUse | None = None, images: ImageReader | None = None) -> ChatPrompt:
        """The conversation as chat turns; a last assistant turn is continued, not answered anew. With
        `images`, a user turn's image blocks are read and checked (serving/images.py carries them)."""
        turns: list[dict] = []
        system = self.system_text()
        if system:
            turns.append({"role": "system", "content": system})
        calls_made: set[str] = set()
        for i, m in enumerate(self.messages):
            texts: list[str] = []
            calls: list[ToolCall] = []
            before = len(images.images) if images is not None else 0
            for block in m.blocks():
                if isinstance(block, TextBlockIn):
                    texts.append(without_markers(block.text) if images is not None else block.text)
                elif isinstance(block, ImageBlockIn):
                    if images is None or m.role != "user":
                        raise ApiError(400, f"messages[{i}]: image blocks are read in user turns, by models that "
                                       "take images", "unsupported_content", "messages")
                    source = block.source
                    if source.type == "url":
                        images.data_url(source.url or "")
                    else:
                        images.base64(source.data or "")
                    texts.append(IMAGE_MARKER)
                elif isinstance(block, ToolUseBlockIn):
                    if m.role != "assistant":
                        raise ApiError(400, f"messages[{i}]: tool_use blocks belong in assistant turns",
                                       "invalid_value", "messages")
                    calls.append(ToolCall(block.id, block.name, json.dumps(block.input)))
                    calls_made.add(block.id)
                else:  # a tool result: a turn of its own, before the user's text
                    if m.role != "user":
                        raise ApiError(400, f"messages[{i}]: tool_result blocks belong in user turns",
                                       "invalid_value", "messages")
                    if block.tool_use_id not in calls_made:
                        raise ApiError(400, f"messages[{i}] has a tool_result for tool_use_id {block.tool_use_id!r}, "
                                       "which no earlier assistant turn used", "invalid_value", "messages")
                    result = block.text()
                    if len(result) > MAX_TOOL_OUTPUT_CHARS:
                        raise ApiError(400, f"messages[{i}]: the tool result has {len(result)} characters; at most "
                                       f"{MAX_TOOL_OUTPUT_CHARS} are accepted", "tool_output_too_large", "messages")
                    turns.append({"role": "tool", "content": result})
            text = "".join(texts)
            if m.role == "assistant":
                turns.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            elif text or not isinstance(m.content, list) or not m.content:
                turn = {"role": "user", "content": text}
                if images is not None and len(images.images) > before:
                    turn["images"] = images.images[before:]
                turns.append(turn)
        last = self.messages[-1]
        prefill = last.role == "assistant" and not any(isinstance(b, ToolUseBlockIn) for b in last.blocks())
        return ChatPrompt(render_messages(turns, tools), continue_final=prefill)

    @staticmethod
    def user_text(prompt: ChatPrompt) -> str:
        """What the caller wrote (system, user turns, tool results): the text input moderation checks."""
        return "\n".join(m["content"] for m in prompt.messages if m["role"] != "assistant")


class MessagesIn(MessagesBase):
    """POST /v1/messages. `max_tokens` is required, as Anthropic's API requires it."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v and any(not s for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    def to_ask(self, user: User, request_id: str, tools: ToolUse | None) -> Ask:
        constraint = checked(tools.constraint(), "the tools", "tools") if tools is not None and tools.forced else None
        # Anthropic's defaults: temperature 1, no nucleus or top-k cut.
        return Ask(user=user, model=self.model, max_tokens=self.max_tokens,
                   temperature=1.0 if self.temperature is None else self.temperature,
                   top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k,
                   stop=tuple(self.stop_sequences or ()), request_id=request_id, param="messages",
                   constraint=constraint, tools=tools)


class CountTokensIn(MessagesBase):
    """POST /v1/messages/count_tokens: the same conversation, counted and not run."""
