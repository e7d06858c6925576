"""Engine-wide counters and a moving tokens/s figure, and the typed snapshot the engine reports."""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatloom.engine.kv_holds import HoldStats
    from chatloom.engine.spec_decode.decoder import SpecDecodeStats


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
    num_waiting_tokens: int = 0  # prompt tokens the waiting requests still need prefilled
    failed_requests: int = 0  # ended by an error attributed to them alone (the rest of their batch went on)
    interrupted_steps: int = 0  # background (batch) steps stopped part-way for foreground work
    # Seconds of steps, by what they carried: any foreground sequence; background (batch) sequences only,
    # run to their end; background steps stopped part-way (their work done again later).
    step_seconds: dict[str, float] = field(default_factory=dict)
    spec_decode: "SpecDecodeStats | None" = None  # None: speculative decoding is off
    kv_holds: "HoldStats | None" = None  # rounds kept while their tools run (kv_holds.py)

    def as_dict(self) -> dict:
        """Flat, for printing and JSON: the speculative counters under their spec_decode_* names, the hold
        counters under kv_hold_*, the step seconds under *_step_seconds."""
        flat = asdict(self)
        flat.update({f"{kind}_step_seconds": v for kind, v in flat.pop("step_seconds").items()})
        flat.pop("spec_decode")
        holds = flat.pop("kv_holds")
        if holds is not None:
            flat.update({f"kv_hold_{k}": v for k, v in holds.items()})
        if self.spec_decode is not None:
            flat.update(self.spec_decode.as_dict())
        return flat


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0
    generated_tokens: int = 0
    aborted: int = 0
    failed: int = 0  # requests ended by an error attributed to them alone
    interrupted: int = 0  # background steps stopped part-way for foreground work (run again later)
    # What EngineSnapshot.step_seconds reports: time a step took, by what it carried.
    foreground_s: float = 0.0
    background_s: float = 0.0
    interrupted_s: float = 0.0
    window_seconds: float = 10.0
    _recent: deque = field(default_factory=deque)  # (time, generated tokens)

    def record_step(self, batch_tokens: int, new_tokens: int, now: float) -> None:
        self.steps += 1
        self.generated_tokens += new_tokens
        self.tokens_computed += batch_tokens
        self._recent.append((now, new_tokens))
        while self._recent and now - self._recent[0][0] > self.window_seconds:
            self._recent.popleft()

    def record_step_time(self, seconds: float, background: bool, interrupted: bool) -> None:
        if interrupted:
            self.interrupted_s += seconds
        elif background:
            self.background_s += seconds
        else:
            self.foreground_s += seconds

    def step_seconds(self) -> dict[str, float]:
        return {"foreground": round(self.foreground_s, 6), "background": round(self.background_s, 6),
                "interrupted": round(self.interrupted_s, 6)}

    def tokens_per_s(self) -> float:
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0
