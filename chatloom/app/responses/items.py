"""Conversation items of the Responses API: what a request's `input` may hold, each item as stored (with
its id, in the API's own shape), and a thread of items as the chat turns the prompt is rendered from.

Items: messages (roles user, assistant, system, developer; content as a string or text parts, and in user
messages `input_image` parts: an image_url, data or http(s), or the file_id of an uploaded image), the
model's function calls (`function_call`) and their results (`function_call_output`), the built-in tools'
calls as an earlier response gave them (hosted_calls.py), and the model's reasoning (`reasoning`, kept in
the thread but not shown to the model again, as chat templates drop earlier thinking). A function call's
output must answer a call made earlier in the thread.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chatloom.app.core.errors import ApiError
from chatloom.app.generation.tool_calls import ToolCall
from chatloom.app.responses.hosted_calls import HostedItemIn, hosted_turns, input_item
from chatloom.serving.images import IMAGE_MARKER
from chatloom.store import new_id

LENIENT = ConfigDict(extra="ignore")
TEXT_PARTS = ("input_text", "output_text", "text")


class ContentPartIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class MessageItemIn(BaseModel):
    model_config = LENIENT
    type: Literal["message"] = "message"
    id: str | None = Field(default=None, max_length=64)
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPartIn]


class FunctionCallItemIn(BaseModel):
    model_config = LENIENT
    type: Literal["function_call"]
    id: str | None = Field(default=None, max_length=64)
    call_id: str = Field(min_length=1, max_length=64)
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class FunctionCallOutputItemIn(BaseModel):
    model_config = LENIENT
    type: Literal["function_call_output"]
    id: str | None = Field(default=None, max_length=64)
    call_id: str = Field(min_length=1, max_length=64)
    output: str | list[ContentPartIn]


class ReasoningItemIn(BaseModel):
    model_config = LENIENT
    type: Literal["reasoning"]
    id: str | None = Field(default=None, max_length=64)
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None


ITEM_TYPES: dict[str, type[BaseModel]] = {"message": MessageItemIn, "function_call": FunctionCallItemIn,
                                          "function_call_output": FunctionCallOutputItemIn,
                                          "reasoning": ReasoningItemIn, "web_search_call": HostedItemIn,
                                          "file_search_call": HostedItemIn, "code_interpreter_call": HostedItemIn,
                                          "mcp_call": HostedItemIn, "mcp_list_tools": HostedItemIn}


def _text_of(parts: str | list[ContentPartIn], where: str) -> str:
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if part.type not in TEXT_PARTS or part.text is None:
            raise ApiError(400, f"{where}.content[{j}] is of type {part.type!r}; only text parts (input_text, "
                           "output_text) are supported", "unsupported_content", "input")
        texts.append(part.text)
    return "".join(texts)


def _image_part(part: ContentPartIn, where: str) -> dict:
    """An input_image part as stored: its image_url or file_id (read when the prompt is built)."""
    extra = part.model_extra or {}
    url, file_id = extra.get("image_url"), extra.get("file_id")
    url = url.get("url") if isinstance(url, dict) else url
    if (url is None) == (file_id is None) or not isinstance(url if url is not None else file_id, str):
        raise ApiError(400, f"{where} is an input_image part; it needs either an image_url (a data URL or an "
                       "http(s) URL) or the file_id of an uploaded image", "invalid_value", "input")
    return {"type": "input_image", "image_url": url, "file_id": file_id, "detail": extra.get("detail") or "auto"}


def _user_parts(parts: list[ContentPartIn], where: str) -> list[dict]:
    """A user message's text and image parts, in order."""
    out = []
    for j, part in enumerate(parts):
        if part.type == "input_image":
            out.append(_image_part(part, f"{where}.content[{j}]"))
        elif part.type in TEXT_PARTS and part.text is not None:
            out.append({"type": "input_text", "text": part.text})
        else:
            raise ApiError(400, f"{where}.content[{j}] is of type {part.type!r}; a user message takes input_text "
                           "and input_image parts", "unsupported_content", "input")
    return out


def _validated(raw: Any, i: int) -> BaseModel:
    where = f"input[{i}]"
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where} must be an object (a message or another item)", "invalid_value", "input")
    kind = raw.get("type", "message")
    model = ITEM_TYPES.get(kind)
    if model is None:
        raise ApiError(400, f"{where} is an item of type {kind!r}, which this server does not take; send "
                       f"one of {', '.join(ITEM_TYPES)}", "unsupported_value", "input")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"])
        raise ApiError(400, f"{where}{field}: {err['msg']}", "invalid_value", "input") from None


def input_items(value: str | list) -> list[dict]:
    """A request's `input` as stored items, each with an id (kept when the client gave one); 400 for an
    item this server cannot read, naming its place."""
    if isinstance(value, str):
        return [message_item("user", value)]
    if not value:
        raise ApiError(400, "input must not be empty", "invalid_value", "input")
    items = []
    for i, raw in enumerate(value):
        item = _validated(raw, i)
        where = f"input[{i}]"
        if isinstance(item, MessageItemIn):
            if item.role == "user" and not isinstance(item.content, str) and any(
                    p.type == "input_image" for p in item.content):
                items.append({"type": "message", "id": item.id or new_id("msg"), "role": "user",
                              "status": "completed", "content": _user_parts(item.content, where)})
                continue
            items.append(message_item(item.role, _text_of(item.content, where), item.id))
        elif isinstance(item, FunctionCallItemIn):
            items.append(function_call_item(ToolCall(item.call_id, item.name, item.arguments), item.id))
        elif isinstance(item, HostedItemIn):
            items.append(input_item(item))
        elif isinstance(item, FunctionCallOutputItemIn):
            items.append({"type": "function_call_output", "id": item.id or new_id("fco"), "call_id": item.call_id,
                          "output": _text_of(item.output, where), "status": "completed"})
        else:
            items.append({"type": "reasoning", "id": item.id or new_id("rs"), "summary": item.summary,
                          **({"content": item.content} if item.content is not None else {})})
    return items


# -- items as the API shows them ---------------------------------------------------------------------

def message_item(role: str, text: str, item_id: str | None = None, status: str = "completed") -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    part: dict = {"type": kind, "text": text}
    if kind == "output_text":
        part.update(annotations=[], logprobs=[])
    return {"type": "message", "id": item_id or new_id("msg"), "role": role, "status": status, "content": [part]}


def function_call_item(call: ToolCall, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def output_text(items: list[dict]) -> str:
    return "".join(p.get("text", "") for it in items if it["type"] == "message" and it["role"] == "assistant"
                   for p in it["content"])


# -- a thread as chat turns ------------------------------------------------------------------------------

def prompt_turns(instructions: str | None, items: list[dict], max_output_chars: int) -> list[dict]:
    """The instructions (a system turn; those of earlier responses are not carried over, as OpenAI does),
    then the thread."""
    head = [{"role": "system", "content": instructions}] if instructions else []
    return head + chat_turns(items, max_output_chars)


def chat_turns(items: list[dict], max_output_chars: int) -> list[dict]:
    """The thread as {role, content, tool_calls?} turns for tool_calls.render_messages: developer turns are
    system turns, a function call joins the assistant turn just before it (or starts one), a function
    call's output is a `role: tool` turn. 400 for an output that answers no earlier call or is too long."""
    turns: list[dict] = []
    calls_made: set[str] = set()
    for item in items:
        kind = item["type"]
        if hosted_turns(item, turns):  # a built-in tool's call and result, kept with the stored response
            continue
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            images = [p for p in item["content"] if p["type"] == "input_image"]
            if images:  # the API room reads them into the turn's images (api/response_images.py)
                text = "".join(IMAGE_MARKER if p["type"] == "input_image" else
                               p.get("text", "").replace(IMAGE_MARKER, "") for p in item["content"])
                turns.append({"role": role, "content": text, "image_refs": images})
                continue
            turns.append({"role": role, "content": "".join(p.get("text", "") for p in item["content"])})
        elif kind == "function_call":
            call = ToolCall(item["call_id"], item["name"], item["arguments"])
            calls_made.add(call.id)
            if turns and turns[-1]["role"] == "assistant":
                turns[-1].setdefault("tool_calls", []).append(call)
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if item["call_id"] not in calls_made:
                raise ApiError(400, f"the function_call_output {item['id']} answers call_id {item['call_id']!r}, "
                               "which no earlier function_call in the thread made", "invalid_value", "input")
            if len(item["output"]) > max_output_chars:
                raise ApiError(400, f"the function_call_output for call_id {item['call_id']!r} has "
                               f"{len(item['output'])} characters; at most {max_output_chars} are accepted",
                               "tool_output_too_large", "input")
            turns.append({"role": "tool", "content": item["output"]})
    return turns

