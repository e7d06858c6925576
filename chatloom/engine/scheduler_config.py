"""The scheduler's limits (`SchedulerConfig`), read from the engine's configuration (config.py) or,
in the fleet simulator, from the replica it stands in for. Apart from config.py so that the scheduler
and the simulator load without torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class EngineLimits(Protocol):
    """What the scheduler reads of an engine's configuration (config.EngineConfig has it), named here
    rather than imported so that this module needs nothing of config.py."""

    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool
    background_priority: int | None
    background_yield: str
    background_step_tokens: int | None

# A step of background sequences alone on a CPU carries at most this many tokens (engine.background_step_tokens).
CPU_BACKGROUND_STEP_TOKENS = 32


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits. No defaults: they come from an EngineConfig (`from_engine`) or, in the
    simulator, from the replica it stands in for."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    # Off: a prompt is prefilled in one step however long (for the sake of comparison).
    enable_chunked_prefill: bool
    # Sequences of this priority or above (batch work) leave a step that carries a prompt chunk of a
    # higher-priority sequence; None: every sequence runs whenever it fits.
    background_priority: int | None
    # "prefill": they sit out steps that read a foreground prompt; "step": every step with foreground work.
    background_yield: str
    # The most tokens of a step when only background sequences are queued (None: max_num_batched_tokens).
    background_step_tokens: int | None

    @classmethod
    def from_engine(cls, config: EngineLimits, max_model_len: int, device: str = "cpu") -> "SchedulerConfig":
        """The limits of `config`, with its context window resolved (`EngineConfig.resolve_max_model_len`)
        and "auto" choices made for the model's `device` type."""
        yield_ = config.background_yield
        if yield_ == "auto":
            # A CPU step costs in proportion to the sequences it carries; a GPU decode step barely grows.
            yield_ = "step" if device == "cpu" else "prefill"
        step_tokens = config.background_step_tokens
        if step_tokens is None and device == "cpu":
            # A CPU step's time grows with its tokens: a short background step keeps an interactive arrival's
            # wait short at little cost to the batch (the time per token barely changes).
            step_tokens = CPU_BACKGROUND_STEP_TOKENS
        return cls(max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                   max_model_len=max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
                   background_priority=config.background_priority, background_yield=yield_,
                   background_step_tokens=step_tokens)
