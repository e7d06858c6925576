"""The engine's one configuration, and what its parts derive from it.

EngineConfig holds every knob of one replica (the KV pool, the per-step budget, speculative decoding);
the scheduler's limits are read from it (`SchedulerConfig.from_engine`), never given defaults of their
own, so one number cannot disagree with another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from chatloom.engine.kv_sizing import KVPoolPlan, plan_kv_pool
# The scheduler's limits live apart (no torch there): the fleet simulator builds them for its replicas.
from chatloom.engine.scheduler_config import CPU_BACKGROUND_STEP_TOKENS, SchedulerConfig  # noqa: F401
from chatloom.models.memory_check import available_memory_bytes
from chatloom.settings import DEFAULTS
from chatloom.settings.tree import EngineSettings

_E = DEFAULTS.engine  # every default below is the settings tree's

# What the KV pool may hold: "auto" is the model's own dtype, or a 16-bit pool where the model
# multiplies with int8 activations or bfloat16 weights (those modes are not bit-exact anyway, and a
# decode step's attention reads half the bytes).
KV_CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT8_MODE_KV_CACHE_DTYPE = "fp16"
# The longest context a replica serves unless told otherwise: a model's full window (often 128k) would
# let one request take a whole pool.
DEFAULT_MAX_MODEL_LEN = 8192


def resolve_kv_cache_dtype(choice: str, model_dtype: torch.dtype, int8_matmul: bool,
                           bf16_matmul: bool = False) -> torch.dtype:
    """The KV pool's dtype for `choice` ("auto", "fp32", "bf16" or "fp16"): with "auto", the model's
    dtype in the exact mode, a 16-bit pool where the matmuls already round (int8 or bf16 matmuls)."""
    if choice == "auto":
        return KV_CACHE_DTYPES[INT8_MODE_KV_CACHE_DTYPE] if int8_matmul or bf16_matmul else model_dtype
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {choice!r}: use auto, {', '.join(KV_CACHE_DTYPES)}")
    if model_dtype == torch.float64:
        raise ValueError("the float64 reference model keeps its KV cache in float64 (kv_cache_dtype auto)")
    return KV_CACHE_DTYPES[choice]


@dataclass
class EngineConfig:
    """Every setting of one engine replica; the defaults are the settings tree's engine group."""

    block_size: int = _E.block_size
    num_blocks: int | None = _E.num_blocks  # overrides kv_cache_gb when set
    kv_cache_gb: float | None = _E.kv_cache_gb  # neither set: sized from the model and memory (kv_sizing.py)
    max_num_batched_tokens: int = _E.max_num_batched_tokens
    max_num_seqs: int = _E.max_num_seqs
    max_model_len: int | None = _E.context_window  # default: the model's context length, capped at DEFAULT_MAX_MODEL_LEN
    # "auto" (the model's dtype; fp16 with int8 matmuls), "fp32", "bf16" or "fp16".
    kv_cache_dtype: str = _E.kv_cache_dtype
    enable_prefix_caching: bool = _E.enable_prefix_caching
    enable_chunked_prefill: bool = _E.enable_chunked_prefill
    encoder_cache_mb: float = _E.encoder_cache_mb  # image embeddings kept by image hash (vision models)
    # While other requests share the engine, the encoder gets at most this fraction of the time (encoder_plan.py).
    encoder_max_slowdown: float = _E.encoder_max_slowdown
    seed: int | None = None  # for unseeded sampled requests
    # Speculative decoding (engine/spec_decode/): "off", "ngram" (prompt lookup) or "draft".
    speculative: str = _E.speculative
    num_speculative_tokens: int = _E.num_speculative_tokens  # the most tokens proposed per sequence and step
    speculative_model: str | None = _E.speculative_model  # for "draft": a registry id, path, or self-int8 / self-layers:N
    speculative_adaptive: bool = _E.speculative_adaptive  # choose k per step from acceptance and measured step cost
    background_priority: int | None = _E.background_priority  # at or above: sit out steps with foreground work
    background_yield: str = _E.background_yield  # "auto", "prefill" or "step": which steps they sit out
    background_step_tokens: int | None = _E.background_step_tokens  # a background-only step's most tokens
    background_interrupt: bool = _E.background_interrupt  # stop a background-only step for foreground work

    @classmethod
    def from_settings(cls, engine: EngineSettings) -> "EngineConfig":
        """The engine sizing the settings tree's engine group asks for."""
        return cls(block_size=engine.block_size, num_blocks=engine.num_blocks, kv_cache_gb=engine.kv_cache_gb,
                   max_num_batched_tokens=engine.max_num_batched_tokens, max_num_seqs=engine.max_num_seqs,
                   max_model_len=engine.context_window, kv_cache_dtype=engine.kv_cache_dtype,
                   enable_prefix_caching=engine.enable_prefix_caching,
                   enable_chunked_prefill=engine.enable_chunked_prefill, encoder_cache_mb=engine.encoder_cache_mb,
                   encoder_max_slowdown=engine.encoder_max_slowdown,
                   speculative=engine.speculative,
                   num_speculative_tokens=engine.num_speculative_tokens,
                   speculative_model=engine.speculative_model, speculative_adaptive=engine.speculative_adaptive,
                   background_priority=engine.background_priority, background_yield=engine.background_yield,
                   background_step_tokens=engine.background_step_tokens,
                   background_interrupt=engine.background_interrupt)

    def resolve_max_model_len(self, max_position: int) -> int:
        """The context window for a model that knows `max_position` positions."""
        return self.max_model_len or min(max_position, DEFAULT_MAX_MODEL_LEN)

    def plan_kv_pool(self, kv_bytes_per_token: int, max_position: int, window: int | None = None,
                     available: int | None = None, reserved: int = 0) -> KVPoolPlan:
        """The KV pool for a model of `max_position` positions storing `kv_bytes_per_token`: num_blocks,
        kv_cache_gb, or sized from the memory `available` (measured now when not given) less `reserved`
        bytes (the weights, when sized before they are loaded). `window`: the attention window every
        layer has, if any."""
        if self.num_blocks is None and self.kv_cache_gb is None and available is None:
            available = available_memory_bytes()
        if available is not None:
            available = max(0, available - reserved)
        return plan_kv_pool(kv_bytes_per_token, self.block_size, self.resolve_max_model_len(max_position),
                            num_blocks=self.num_blocks, kv_cache_gb=self.kv_cache_gb, available=available,
                            window=window)
