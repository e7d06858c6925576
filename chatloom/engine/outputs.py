"""What the engine reports about a request after each step."""
from __future__ import annotations

from dataclasses import dataclass, field

from chatloom.engine.sequence import RequestMetrics


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability under the model, and the likeliest tokens at its place (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    request_id: str
    delta_text: str  # text new since the last output of this request
    delta_token_ids: list[int]
    text: str  # all text so far
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    token_ids: list[int] = field(default_factory=list)  # all output tokens, on the final output
    error: str | None = None  # with finish_reason 'error': why this request (alone) failed
    stop_str: str | None = None  # with finish_reason 'stop': the stop string that ended it (None: an end token)
    index: int = 0  # which of the request's n choices this output belongs to
    # Where the request asks (SamplingParams.logprobs): one per token new in this output, the end token
    # that finishes a choice left out.
    logprobs: list[TokenLogprob] | None = None
    # On a choice's first output, where asked: one per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
