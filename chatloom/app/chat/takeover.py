"""Continuing an answer another process began: the prompt plus the text produced so far is the new prompt.

When a gateway dies mid-answer, the answer's event log still holds every piece of text its
readers were sent. The gateway that takes the job over renders the same chat prompt with that
text as the start of the assistant's turn (ChatPrompt(continue_final=True), as /continue does),
and lets the model go on from there; the new pieces are appended to the same log, so a client
resuming with Last-Event-ID sees one contiguous answer. This is the router's continuation for a dead replica, done with the logged
text instead of token ids (a gateway logs text).
"""
from __future__ import annotations

from chatloom.serving import Backend


def can_continue(backend: Backend) -> bool:
    """A backend with a local tokenizer renders chat prompts itself, so it can continue an assistant turn."""
    try:
        return backend.tokenizer is not None
    except Exception:
        return False


def logged_text(events: list) -> str:
    """The answer text a log's events carry (what readers were shown)."""
    return "".join(e.data.get("token", "") for e in events if isinstance(e.data, dict))


def logged_answer_tokens(events: list) -> int | None:
    """The answer tokens its writer had made by its last logged piece (None: no piece carries a count)."""
    for e in reversed(events):
        if getattr(e, "answer_tokens", None) is not None:
            return e.answer_tokens
    return None
