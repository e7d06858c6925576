"""What a request asks of generation: length, randomness and when to stop."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from chatloom.engine.structured.constraint import Constraint, ConstraintError
from chatloom.settings import DEFAULTS

# Below these, sampling is greedy: dividing logits by a smaller temperature overflows float32
# (1e-40 is a denormal, 1e-320 rounds to 0), and a smaller nucleus keeps only the top token anyway.
TEMPERATURE_FLOOR = 1e-5
TOP_P_FLOOR = 1e-6
# Seeds are signed 64-bit integers (what torch and every SQL column can hold).
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
# The most alternatives a request may ask to see per token (OpenAI's limit for top_logprobs).
MAX_LOGPROBS = 20


class InvalidRequest(ValueError):
    """A request the engine cannot take; the message names the problem."""


@dataclass
class SamplingParams:
    # The defaults are the settings tree's [sampling] group, as on every front.
    max_tokens: int = DEFAULTS.sampling.max_tokens
    temperature: float = DEFAULTS.sampling.temperature
    top_p: float = DEFAULTS.sampling.top_p
    top_k: int = DEFAULTS.sampling.top_k  # 0 or -1: off
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Output limited to a grammar (JSON, schema, regex, choices); such a request never speculates.
    constraint: Constraint | None = None
    # Several answers to one prompt: the prompt is computed once and its blocks shared (choices.py).
    n: int = 1
    # Log probabilities of each output token and of its `logprobs` likeliest alternatives (0: the
    # token's own only); `prompt_logprobs` the same for the prompt's tokens. None: not computed.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # A round of an answer that may call tools: when it finishes, its blocks are kept under its request id
    # until the caller decides to hold or evict them (kv_holds.py). `resume_of`: the request id of the round
    # this request resumes, whose kept blocks it adopts.
    keep_kv: bool = False
    resume_of: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("temperature must be a finite number >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequest("top_p must be in (0, 1]")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidRequest(f"seed must be a signed 64-bit integer ({SEED_MIN} to {SEED_MAX})")
        if self.top_k < -1:
            raise InvalidRequest("top_k must be -1, 0 (off) or positive")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens must be between 0 and max_tokens")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must not be empty")
        if self.n < 1:
            raise InvalidRequest("n must be at least 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequest(f"{name} must be between 0 and {MAX_LOGPROBS}")
        if self.constraint is not None:
            try:
                self.constraint.check()
            except ConstraintError as exc:
                raise InvalidRequest(str(exc)) from None

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR or self.top_k == 1 or self.top_p < TOP_P_FLOOR
