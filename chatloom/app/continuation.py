"""Continuing an answer another process began: the prompt plus the text produced so far is the new prompt.

When a gateway dies mid-answer, the answer's event log still holds every piece of text its
readers were sent. The gateway that takes the job over renders the same chat prompt, appends that
text as the start of the assistant's turn (no end-of-turn marker), and lets the model go on from
there; the new pieces are appended to the same log, so a client resuming with Last-Event-ID sees
one contiguous answer. This is the router's continuation for a dead replica, done with the logged
text instead of token ids (a gateway logs text).
"""
from __future__ import annotations

from chatloom.models.chat_template import render_chat
from chatloom.serving import Backend


def continuation_prompt(backend: Backend, messages: list[dict], partial: str) -> str | None:
    """The raw prompt that continues `partial` as the assistant's answer to `messages`; None when the
    backend does not expose its chat template (a remote server), so the answer cannot be continued."""
    if not can_continue(backend):
        return None
    tok = backend.tokenizer
    bos = getattr(tok, "bos_token", None) or ""
    # The same rendering the backend gives chat messages (its template, or the fallback one).
    text = render_chat(getattr(tok, "chat_template", None), messages, add_generation_prompt=True, bos_token=bos,
                       eos_token=getattr(tok, "eos_token", None) or "")
    if bos and text.startswith(bos):  # the encoder adds the BOS token itself
        text = text[len(bos):]
    return text + partial


def can_continue(backend: Backend) -> bool:
    """A backend with a local tokenizer renders chat prompts itself, so a raw prompt can extend one."""
    try:
        return backend.tokenizer is not None
    except Exception:
        return False


def logged_text(events: list) -> str:
    """The answer text a log's events carry (what readers were shown)."""
    return "".join(e.data.get("token", "") for e in events if isinstance(e.data, dict))
