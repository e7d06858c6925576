"""Engine-wide counters and a moving tokens/s figure, and the typed snapshot the engine reports."""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's load at one moment (vLLM's names), for backends, metrics and routing."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    kv_cache_blocks: int
    kv_cache_free_blocks: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    prefix_cache_evictions: int
    num_preemptions: int
    steps: int
    generated_tokens: int
    aborted_requests: int
    generation_tokens_per_s: float
    # Speculative decoding (vLLM's spec_decode counters); None when it is off.
    spec_decode_num_drafts: int | None = None
    spec_decode_num_draft_tokens: int | None = None
    spec_decode_num_accepted_tokens: int | None = None
    spec_decode_num_emitted_tokens: int | None = None
    spec_decode_acceptance_rate: float | None = None
    spec_decode_spec_steps: int | None = None  # steps with any proposed token
    spec_decode_plain_steps: int | None = None  # decode steps where the planner chose not to speculate

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0
    generated_tokens: int = 0
    aborted: int = 0
    window_seconds: float = 10.0
    _recent: deque = field(default_factory=deque)  # (time, generated tokens)

    def record_step(self, batch_tokens: int, new_tokens: int, now: float) -> None:
        self.steps += 1
        self.generated_tokens += new_tokens
        self.tokens_computed += batch_tokens
        self._recent.append((now, new_tokens))
        while self._recent and now - self._recent[0][0] > self.window_seconds:
            self._recent.popleft()

    def tokens_per_s(self) -> float:
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0
