"""A deterministic stand-in for the model: a `Backend` whose answers are scripted by the question,
streamed word by word with a small delay so the browser sees them arrive."""
from __future__ import annotations

import asyncio
import itertools
import json
import re

from chatloom.serving import Backend, Delta, GenerationRequest

MARKDOWN_ANSWER = """## A short answer

Here is **bold**, *italic* and `inline code`, with a [link](https://example.com/docs).

- first point
- second point

```python
def greet(name):
    return f"hello {name}" if name else "<nobody>"
```

That is all."""

INJECTION_ANSWER = """Trying: <img src=x onerror=alert(1)> and <script>alert("xss")</script>
and [click me](javascript:alert(1)) and <a href="javascript:alert(2)">link</a>
<svg onload=alert(3)></svg> `<b onmouseover=alert(4)>code</b>` [ok](https://example.com/"onmouseover="alert(5))"""


def words(text: str) -> list[str]:
    """Split into tokens that join back to the text exactly (each word keeps its leading space)."""
    out: list[str] = []
    for i, part in enumerate(text.split(" ")):
        out.append(part if i == 0 else " " + part)
    return [w for w in out if w]


class ScriptedBackend(Backend):
    def __init__(self, delay_s: float = 0.03) -> None:
        self.delay_s = delay_s
        self._aborted: set[str] = set()
        self._counter = itertools.count(1)

    ready = property(lambda self: True)
    model_ids = property(lambda self: ["scripted", "scripted-large"])
    context_window = property(lambda self: 8192)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def count_prompt_tokens(self, messages: list[dict]) -> int:
        return sum(self.count_tokens(m["content"]) + 4 for m in messages) + 2

    def answer_for(self, question: str) -> str:
        q = question.lower()
        n = next(self._counter)
        if "inject" in q:
            return INJECTION_ANSWER
        if "markdown" in q:
            return MARKDOWN_ANSWER
        if "long" in q:
            return " ".join(f"word{i}" for i in range(1, 400))
        return f"Answer number {n} to: {question} " + " ".join(["and", "some", "more", "words"] * 3) + " done."

    @staticmethod
    def tool_answer(messages: list[dict]) -> str | None:
        """With chat tools offered: 'calculate X' calls the calculator, 'run python: CODE' the code
        interpreter, and the next round reports the result."""
        if not messages or "<tools>" not in messages[0]["content"]:
            return None
        if messages[-1]["role"] == "tool":
            return f"The answer is {messages[-1]['content']}."
        code = re.match(r"run python: (.+)", messages[-1]["content"], re.S)
        if messages[-1]["role"] == "user" and code is not None:
            call = json.dumps({"name": "python", "arguments": {"code": code.group(1).replace("; ", "\n")}})
            return f"I will run it.\n<tool_call>\n{call}\n</tool_call>"
        expr = re.search(r"calculate (.+)", messages[-1]["content"])
        if messages[-1]["role"] != "user" or expr is None:
            return None
        call = json.dumps({"name": "calculator", "arguments": {"expression": expr.group(1).strip()}})
        return f"I will use the calculator.\n<tool_call>\n{call}\n</tool_call>"

    async def stream(self, request: GenerationRequest):
        question = next((m["content"] for m in reversed(request.messages or []) if m["role"] == "user"), "")
        text = self.tool_answer(request.messages or []) or self.answer_for(question)
        # Asked to reason (the app adds <think> instructions with a word budget): think first.
        system = next((m["content"] for m in request.messages or [] if m["role"] == "system"), "")
        budget = re.search(r"<think>.*at most about (\d+) words", system, re.S)
        if budget:
            text = f"<think>Let me weigh this, within a budget of {budget.group(1)} words.</think>\n{text}"
        full = words(text)
        tokens = full[: request.max_tokens]
        rid = request.request_id or ""
        sent = 0
        for token in tokens:
            if rid in self._aborted:
                break
            await asyncio.sleep(self.delay_s * (2 if "markdown" in question.lower() else 1))  # time to watch it grow
            sent += 1
            yield Delta(token)
        reason = "abort" if rid in self._aborted else ("length" if len(full) > len(tokens) else "stop")
        self._aborted.discard(rid)
        yield Delta("", True, reason, self.count_prompt_tokens(request.messages or []), sent)

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
