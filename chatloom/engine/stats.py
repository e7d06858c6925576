"""Engine-wide counters and a moving tokens/s figure."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0
    generated_tokens: int = 0
    aborted: int = 0
    failed: int = 0  # requests ended by an error attributed to them alone
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

    def as_dict(self) -> dict:
        return {"steps": self.steps, "generated_tokens": self.generated_tokens,
                "aborted_requests": self.aborted, "failed_requests": self.failed,
                "generation_tokens_per_s": round(self.tokens_per_s(), 2)}
