"""Engine sizing: the KV pool and the per-step budget."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # overrides kv_cache_gb when set
    kv_cache_gb: float = 1.0
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's context length, capped at 8192
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
