"""A scripted model for the tool tests: a user message `call NAME {json arguments}` makes it call that
tool once; after a tool turn it answers `Result: <the tool turn>`. Everything else is real.

(A uniquely named module: test modules of this folder import it directly.)"""
from __future__ import annotations

import json
import re

from chatloom.serving import Backend, Delta, GenerationRequest


class ToolCallingBackend(Backend):
    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []

    ready = property(lambda self: True)
    model_ids = property(lambda self: ["scripted"])
    context_window = property(lambda self: 32768)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def count_prompt_tokens(self, messages: list[dict]) -> int:
        return sum(self.count_tokens(m["content"]) + 4 for m in messages)

    async def stream(self, request: GenerationRequest):
        self.requests.append(request)
        msgs = request.messages
        question = next(m["content"] for m in reversed(msgs) if m["role"] == "user")
        asked = re.match(r"call (\w+) (\{.*\})\s*$", question, re.S)
        if msgs[-1]["role"] == "tool":
            text = f"Result: {msgs[-1]['content']}"
        elif asked and "<tools>" in msgs[0]["content"]:
            call = json.dumps({"name": asked.group(1), "arguments": json.loads(asked.group(2))})
            text = f"<tool_call>\n{call}\n</tool_call>"
        else:
            text = "No tools needed."
        for i in range(0, len(text), 50):
            yield Delta(text[i:i + 50])
        yield Delta("", True, "stop", self.count_prompt_tokens(msgs), len(text.split()))

    def abort(self, request_id: str) -> None:
        pass


def call_text(tool: str, **arguments: object) -> str:
    return f"call {tool} {json.dumps(arguments)}"
