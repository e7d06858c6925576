"""Engine sizing: the KV pool and the per-step budget."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# What the KV pool may hold: "auto" is the model's own dtype, or a 16-bit pool where the model
# multiplies with int8 activations (that mode is not bit-exact anyway, and a decode step's
# attention reads half the bytes).
KV_CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT8_MODE_KV_CACHE_DTYPE = "fp16"


def resolve_kv_cache_dtype(choice: str, model_dtype: torch.dtype, int8_matmul: bool) -> torch.dtype:
    """The KV pool's dtype for `choice` ("auto", "fp32", "bf16" or "fp16")."""
    if choice == "auto":
        return KV_CACHE_DTYPES[INT8_MODE_KV_CACHE_DTYPE] if int8_matmul else model_dtype
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {choice!r}: use auto, {', '.join(KV_CACHE_DTYPES)}")
    if model_dtype == torch.float64:
        raise ValueError("the float64 reference model keeps its KV cache in float64 (kv_cache_dtype auto)")
    return KV_CACHE_DTYPES[choice]


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # overrides kv_cache_gb when set
    kv_cache_gb: float = 1.0
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's context length, capped at 8192
    # "auto" (the model's dtype; fp16 with int8 matmuls), "fp32", "bf16" or "fp16".
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int | None = None  # for unseeded sampled requests
    # Speculative decoding (engine/spec_decode/): "off", "ngram" (prompt lookup) or "draft".
    speculative: str = "off"
    num_speculative_tokens: int = 4  # the most tokens proposed per sequence and step
    speculative_model: str | None = None  # for "draft": a registry id, path, or self-int8 / self-layers:N
    speculative_adaptive: bool = True  # choose k per step from acceptance and measured step cost

    def resolve_num_blocks(self, kv_bytes_per_token: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return max(1, int(self.kv_cache_gb * 1024**3) // (kv_bytes_per_token * self.block_size))

    def kv_cache_bytes(self, kv_bytes_per_token: int) -> int:
        """Bytes the KV pool will take (what the memory check before loading adds to the weights)."""
        return self.resolve_num_blocks(kv_bytes_per_token) * self.block_size * kv_bytes_per_token
