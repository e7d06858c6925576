"""The reasoning class: answers that think before they speak.

The model is asked to think inside a <think>...</think> block first, with a budget set by an effort
dial (low / medium / high). The thinking streams as separate events and is not part of the answer.
The operator can cap the dial (setting `reasoning_max_effort`, or PUT /admin/reasoning under load).
"""
from __future__ import annotations

EFFORTS = ("low", "medium", "high")
BUDGET_TOKENS = {"low": 256, "medium": 1024, "high": 4096}
OPEN, CLOSE = "<think>", "</think>"


def cap_effort(requested: str, max_effort: str) -> str:
    return EFFORTS[min(EFFORTS.index(requested), EFFORTS.index(max_effort))]


def instructions(effort: str) -> str:
    words = BUDGET_TOKENS[effort] * 3 // 4
    return (f"\n\nBefore answering, think the problem through step by step inside {OPEN} and {CLOSE}, "
            f"using at most about {words} words. After {CLOSE}, write only the final answer.")


def with_instructions(messages: list[dict], effort: str) -> list[dict]:
    """The messages with the thinking instructions added to the system prompt (one is added if none)."""
    extra = instructions(effort)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": (messages[0].get("content") or "") + extra}] + messages[1:]
    return [{"role": "system", "content": extra.strip()}] + messages


class ThinkingSplitter:
    """Splits streamed text into ("thinking", text) and ("answer", text) pieces.

    Tags may arrive split across deltas, so a possible partial tag is held until the next piece
    decides it. Text before a leading <think> is not expected; if the model does not open one, all
    of its text is answer.
    """

    def __init__(self) -> None:
        self._state = "start"
        self._buf = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(OPEN):
                    self._buf = stripped[len(OPEN):]
                    self._state = "thinking"
                    continue
                if OPEN.startswith(stripped):  # undecided: could still become <think>
                    return out
                self._state = "answer"
                continue
            if self._state == "thinking":
                i = self._buf.find(CLOSE)
                if i >= 0:
                    if i:
                        out.append(("thinking", self._buf[:i]))
                    self._buf = self._buf[i + len(CLOSE):].lstrip("\n")
                    self._state = "answer"
                    continue
                keep = _partial_suffix(self._buf, CLOSE)
                if len(self._buf) > keep:
                    out.append(("thinking", self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                return out
            if self._buf:
                out.append(("answer", self._buf))
                self._buf = ""
            return out

    def finish(self) -> list[tuple[str, str]]:
        rest, self._buf = self._buf, ""
        if not rest:
            return []
        return [("thinking" if self._state == "thinking" else "answer", rest)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
