"""The call-block parser (auto mode) and the rendering of tool turns for the chat template."""
from __future__ import annotations

import json

from chatloom.app.generation.tool_calls import ToolCall, ToolCallParser, ToolSpec, ToolUse, render_messages

NAMES = ["add", "get_time"]


def feed(text: str, step: int) -> list:
    parser = ToolCallParser(NAMES)
    out = []
    for i in range(0, len(text), step):
        out += parser.push(text[i:i + step])
    return _merge(out + parser.finish())


def _merge(parts: list) -> list:
    merged: list = []
    for p in parts:
        if isinstance(p, str) and merged and isinstance(merged[-1], str):
            merged[-1] += p
        else:
            merged.append(p)
    return merged


def test_text_and_calls_come_apart_whatever_the_chunking():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    for step in (1, 3, 7, len(text)):
        parts = feed(text, step)
        assert parts[0].strip() == "Let me add."
        calls = [p for p in parts if isinstance(p, ToolCall)]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("get_time", {})]
        assert len(parts) == 3


def test_text_that_only_looks_like_a_tag_is_kept():
    assert feed("a < b and <tool_ is not a call", 2) == ["a < b and <tool_ is not a call"]


def test_a_bad_or_unknown_call_stays_text():
    text = '<tool_call>{"name": "rm", "arguments": {}}</tool_call> and <tool_call>not json</tool_call>'
    assert feed(text, 4) == [text]


def test_an_unclosed_last_call_counts_if_its_json_is_whole():
    parts = feed('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n', 5)
    assert len(parts) == 1 and parts[0].name == "add" and json.loads(parts[0].arguments) == {"a": 1}


def test_tool_turns_render_as_plain_turns_with_the_tools_in_the_system_message():
    use = ToolUse((ToolSpec("add", "Add.", {"type": "object"}),), "auto", True)
    call = ToolCall("call_1", "add", '{"a": 1}')
    out = render_messages([{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "1+?"},
                           {"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "tool", "content": "1"}], use)
    assert out[0]["content"].startswith("Be brief.") and '"name": "add"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'}
    assert out[3] == {"role": "tool", "content": "1"}
    assert render_messages([{"role": "user", "content": "x"}], ToolUse(use.tools, "none")) == [
        {"role": "user", "content": "x"}]
