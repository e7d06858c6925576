"""Function calling: tools described to the model, its calls found in its output, calls forced by a grammar.

The model writes a call as a JSON object inside tags, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(the format SmolLM2 and most open chat models learned). The bundled SmolLM2 GGUF's chat template has no
tool support of its own (it renders only role and content), so the tool list goes into the system message
and earlier calls and results become ordinary turns (`role: tool` included) before the model's own template
renders them. With `tool_choice` "required" or a named function, the answer is constrained by a grammar to
call blocks whose JSON matches the function's parameter schema, so a forced call always parses and validates.
In "auto" mode the model is free and `ToolCallParser` picks the call blocks out of its text as it streams.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal

from chatloom.serving import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Whitespace inside forced JSON: one optional space or newline plus a little indent (not endless blanks).
_WHITESPACE = {"whitespace_pattern": r"[ \n]?[ ]{0,4}"}


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: its name, what it does and its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made. `arguments` is JSON text (as the OpenAI API carries it)."""

    id: str
    name: str
    arguments: str
    raw: str = ""  # the block exactly as the model wrote it, when it came from the model

    @property
    def parsed_arguments(self) -> dict:
        return json.loads(self.arguments)

    def text(self) -> str:
        """The call as the model writes it, for rendering earlier turns (its own words when known, so a
        resumed prompt repeats the generated tokens and hits the prefix cache)."""
        if self.raw:
            return self.raw
        try:
            args = json.loads(self.arguments)
        except ValueError:
            args = self.arguments
        return f"{OPEN}\n{json.dumps({'name': self.name, 'arguments': args})}\n{CLOSE}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolUse:
    """The tools of one request and how they may be used.
    choice: auto (the model decides), none (no calls), required (at least one call), or a tool name."""

    tools: tuple[ToolSpec, ...]
    choice: Literal["auto", "none", "required"] | str = "auto"
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice != "auto"

    def names(self) -> list[str]:
        return [t.name for t in self.tools]

    def constraint(self) -> Constraint | None:
        """For required / named: a grammar allowing only call blocks with schema-valid arguments."""
        if not self.forced:
            return None
        chosen = [t for t in self.tools if self.choice == "required" or t.name == self.choice]
        options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
        schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": _WHITESPACE}
        more = ' ("\\n" call)*' if self.parallel else ""
        grammar = (f"start: call{more}\n"
                   f'call: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"')
        return Constraint("lark", grammar)

    def system_text(self) -> str:
        listing = "\n".join(json.dumps(t.openai()) for t in self.tools)
        one = "" if self.parallel else " Call at most one function."
        must = {"auto": "", "required": " You must call at least one function.",
                }.get(self.choice, f" You must call the function {self.choice}.")
        return ("You can call functions to help answer. The functions you have, as JSON:\n"
                f"<tools>\n{listing}\n</tools>\n"
                "To call one, write its name and arguments as a JSON object between tags, like this:\n"
                f'{OPEN}\n{{"name": "function_name", "arguments": {{"arg": "value"}}}}\n{CLOSE}\n'
                f"Each call's result comes back in a message from the tool.{one}{must}")


def render_messages(messages: list[dict], tools: ToolUse | None) -> list[dict]:
    """OpenAI-shaped turns ({role, content, tool_calls?}) as plain {role, content} turns for the chat
    template: the tool list joins the system message, earlier calls become call blocks, results stay
    `role: tool` turns."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        calls: list[ToolCall] = m.get("tool_calls") or []
        if calls:
            content = "\n".join(([content] if content else []) + [c.text() for c in calls])
        turn = {"role": m["role"], "content": content}
        if m.get("images"):  # a vision model's images travel beside the text (serving/images.py)
            turn["images"] = m["images"]
        out.append(turn)
    if tools is not None and tools.active:
        text = tools.system_text()
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def parse_call(block: str, names: list[str], raw: str = "") -> ToolCall | None:
    """One call block's JSON as a ToolCall, or None when it is not a call to a known tool."""
    try:
        data = json.loads(block)
    except ValueError:
        return None
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), data["name"], json.dumps(args), raw)


class ToolCallParser:
    """Splits streamed answer text into plain text and ToolCalls. Text that might be the start of a
    call tag is held back until it is clear; a block that is not a valid call to a known tool is
    passed on as text, unchanged."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._buf = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    emit = self._buf[:len(self._buf) - keep]
                    if emit.strip():  # blanks wait: they may only separate two calls
                        out.append(emit)
                        self._buf = self._buf[len(emit):]
                    return out
                if self._buf[:at].strip():
                    out.append(self._buf[:at])
                self._buf = self._buf[at + len(OPEN):]
                self._in_call = True
            end = self._buf.find(CLOSE)
            if end < 0:
                return out
            out.append(self._close(self._buf[:end]))
            self._buf = self._buf[end + len(CLOSE):].lstrip("\n") if self._in_call else self._buf
            self._in_call = False

    def finish(self) -> list[str | ToolCall]:
        """At the end of the answer: an unclosed last call still counts if its JSON is whole."""
        out: list[str | ToolCall] = []
        if self._in_call:
            out.append(self._close(self._buf, closed=False))
        elif self._buf.strip() or (self._buf and not self.calls):
            out.append(self._buf)
        self._buf, self._in_call = "", False
        return [p for p in out if p != ""]

    def _close(self, block: str, closed: bool = True) -> str | ToolCall:
        # An answer cut inside a block (finish_reason "length") shows it as written, without a closing tag.
        raw = f"{OPEN}{block}{CLOSE if closed else ''}"
        call = parse_call(block.strip(), self.names, raw)
        if call is None:
            return raw
        self.calls.append(call)
        return call


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
