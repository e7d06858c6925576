"""Log probabilities in OpenAI's two shapes.

Chat completions: `choices[].logprobs.content[]`, one object per token with its text, logprob, UTF-8
bytes and `top_logprobs` (the likeliest tokens at its place, each with the same fields). Completions
(the legacy shape): `tokens`, `token_logprobs`, `top_logprobs` (one {token: logprob} map per token,
holding the likeliest tokens and the chosen one) and `text_offset` (where each token starts in the
choice's text, echoed prompt included), with None for an echoed prompt's first token.
"""
from __future__ import annotations

from chatloom.serving.backend import TextLogprob


def _token(e: TextLogprob) -> dict:
    return {"token": e.token, "logprob": e.logprob, "bytes": e.bytes}


def chat_logprobs(entries: list[TextLogprob]) -> dict:
    return {"content": [{**_token(e), "top_logprobs": [_token(t) for t in e.top]} for e in entries],
            "refusal": None}


class CompletionLogprobs:
    """One choice's logprobs in the completions shape, block by block as they stream (the text offsets
    run on from one block to the next)."""

    def __init__(self) -> None:
        self.offset = 0

    def block(self, entries: list[TextLogprob]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e.token)
            out["token_logprobs"].append(e.logprob)
            top = None if e.logprob is None else {t.token: t.logprob for t in e.top} | {e.token: e.logprob}
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
        return out


def join_blocks(blocks: list[dict]) -> dict:
    """Several completion blocks as one (a whole answer)."""
    return {key: [v for b in blocks for v in b[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                 "text_offset")}
