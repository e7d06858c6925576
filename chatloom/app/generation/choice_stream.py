"""One choice's way from the backend's deltas to the pipeline's pieces.

A run has one choice, or n of them when the ask says so; each has its own thinking splitter, output
guard and tool-call parser, and its own log probabilities. The log probabilities of tokens travel with
the text they belong to, and no sooner: the output guard holds text back, and a token's logprob entry
names the token, so an entry is handed out only once the guard has shown as much text as had arrived
with it (and never, where the guard blocks the answer).
"""
from __future__ import annotations

from collections import deque

from chatloom.app.generation.run_types import AnswerText, PromptLogprobs, Thinking
from chatloom.app.generation.tool_calls import ToolCall, ToolCallParser
from chatloom.app.traffic import reasoning
from chatloom.app.traffic.moderation import OutputGuard
from chatloom.serving import Delta
from chatloom.serving.backend import TextLogprob

REPLACEMENT_CHAR = "\ufffd"


class ChoiceStream:
    def __init__(self, guard: OutputGuard, splitter: reasoning.ThinkingSplitter | None,
                 calls: ToolCallParser | None) -> None:
        self.guard = guard
        self.splitter = splitter
        self.calls = calls
        self.blocked_reported = False  # the guard's verdict has been counted
        self._received = 0  # characters of text that arrived
        self._shown = 0  # characters of them handed out
        self._pending: deque[tuple[int, list[TextLogprob]]] = deque()  # (text received with them, entries)
        self._ready: list[TextLogprob] = []  # entries whose text is out, for the next answer piece
        self._prompt_sent = False

    async def feed(self, delta: Delta) -> list:
        """The pieces `delta` gives (none once the guard has blocked the answer)."""
        cut = delta.finished and delta.finish_reason in ("length", "abort")
        text = _drop_cut_character(delta.text) if cut else delta.text
        out: list = []
        if delta.prompt_logprobs is not None and not self._prompt_sent:
            self._prompt_sent = True
            out.append(PromptLogprobs(tuple(delta.prompt_logprobs)))
        self._received += len(text)
        if delta.logprobs:
            self._pending.append((self._received, list(delta.logprobs)))
        guard = self.guard
        if guard.verdict is not None:
            return out
        parts = self.splitter.push(text) if self.splitter else [("answer", text)] if text else []
        if delta.finished and self.splitter:
            parts += self.splitter.finish()
        for kind, part in parts:
            if kind == "thinking":
                self._shown += len(part)
                out.append(Thinking(part))
            else:
                for shown in await guard.push(part):
                    out += self._answer(shown)
        if delta.finished and guard.verdict is None:
            for shown in await guard.finish():
                out += self._answer(shown)
            out += self._answer(None)
        if guard.verdict is not None:  # blocked: what the held-back text's tokens were is not shown either
            self._pending.clear()
            self._ready = []
        return out

    def finish_reason(self, delta: Delta) -> str:
        """The choice's finish reason, once its last delta has been fed."""
        reason = "content_filter" if self.guard.verdict else (delta.finish_reason or "stop")
        if self.calls is not None and self.calls.calls and reason == "stop":
            return "tool_calls"
        return reason

    def _answer(self, text: str | None) -> list:
        """Pieces for answer text the guard let through (None: the answer ended), with the logprob
        entries whose text is now out."""
        if text is not None:
            self._shown += len(text)
            while self._pending and self._pending[0][0] <= self._shown:
                self._ready += self._pending.popleft()[1]
            parts = self.calls.push(text) if self.calls is not None else [text]
        else:
            while self._pending:
                self._ready += self._pending.popleft()[1]
            parts = self.calls.finish() if self.calls is not None else []
        out: list = [p if isinstance(p, ToolCall) else AnswerText(p) for p in parts if p]
        if self._ready:
            at = next((i for i, p in enumerate(out) if isinstance(p, AnswerText)), None)
            if at is not None:
                out[at] = AnswerText(out[at].text, tuple(self._ready))
                self._ready = []
            elif text is None:  # the end: entries of tokens whose text went nowhere visible
                out.append(AnswerText("", tuple(self._ready)))
                self._ready = []
        return out


def _drop_cut_character(text: str) -> str:
    """An answer cut (by max_tokens or a stop) in the middle of a multi-byte character ends in U+FFFD,
    the decoder's stand-in for the partial bytes: drop it rather than show a broken character."""
    return text.rstrip(REPLACEMENT_CHAR)
