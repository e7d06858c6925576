"""How many KV blocks a replica gets: asked for in blocks or GiB, or sized from the model and the machine.

With neither `num_blocks` nor `kv_cache_gb` set, the pool is sized to hold AUTO_KV_CONTEXTS sequences at
the full context window (so one long conversation never finds the pool smaller than its window, and a
few can run side by side), but takes at most AUTO_KV_MEMORY_SHARE of the memory still available (after
the weights, when sized after loading): the rest is left to the process's own working memory, the page
cache and whatever else runs on the machine. Untouched pool pages cost no resident memory (the pool is
zero-filled by the kernel on first write), so a large pool is only paid for as conversations fill it.

A model whose every layer attends within a window keeps at most about a window's blocks per sequence
(the older ones are given back as the sequence moves on: kv_cache_manager.py), so its full context
needs only `window_blocks` blocks, not the whole window.
"""
from __future__ import annotations

from dataclasses import dataclass, asdict

AUTO_KV_CONTEXTS = 4
AUTO_KV_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class KVPoolPlan:
    """A KV pool's size and how it was reached (`chatloom capacity` prints it)."""

    how: str  # "num_blocks", "kv_cache_gb", "auto" or "auto-unknown-memory"
    blocks: int
    block_size: int
    bytes_per_token: int
    context_tokens: int  # the context window the pool is sized for
    tokens_per_context: int  # pool tokens one full-length sequence holds (less than context with a window)
    wanted_bytes: int | None = None  # auto: AUTO_KV_CONTEXTS full contexts
    available_bytes: int | None = None  # auto: the memory available when sized
    cap_bytes: int | None = None  # auto: AUTO_KV_MEMORY_SHARE of it

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    @property
    def full_contexts(self) -> float:
        """How many sequences at the full context window fit at once."""
        return self.tokens / self.tokens_per_context

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens": self.tokens, "bytes": self.bytes,
                "full_contexts": round(self.full_contexts, 2)}


def uniform_window(layer_windows: list[int | None] | None) -> int | None:
    """The window that bounds what every layer reads (the widest of them), or None when any layer
    attends to the whole context."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(layer_windows)


def window_tokens(window: int | None, context: int, block_size: int) -> int:
    """Pool tokens one sequence of `context` tokens holds at most: all of them, or with a window on every
    layer the blocks that can still hold a key inside it (plus the one being filled)."""
    if window is None or window >= context:
        return context
    return min(context, (-(-window // block_size) + 2) * block_size)


def plan_kv_pool(bytes_per_token: int, block_size: int, context: int, *, num_blocks: int | None = None,
                 kv_cache_gb: float | None = None, available: int | None = None,
                 window: int | None = None) -> KVPoolPlan:
    """The pool for a model storing `bytes_per_token` per token with a `context`-token window: `num_blocks`
    if given, else `kv_cache_gb` GiB, else AUTO_KV_CONTEXTS full contexts capped by AUTO_KV_MEMORY_SHARE of
    `available` bytes (one full context when the memory available is unknown)."""
    per_block = bytes_per_token * block_size
    per_context = window_tokens(window, context, block_size)
    common = dict(block_size=block_size, bytes_per_token=bytes_per_token, context_tokens=context,
                  tokens_per_context=per_context)
    if num_blocks is not None:
        return KVPoolPlan("num_blocks", num_blocks, **common)
    if kv_cache_gb is not None:
        return KVPoolPlan("kv_cache_gb", max(1, int(kv_cache_gb * 1024**3) // per_block), **common)
    context_blocks = -(-per_context // block_size)
    wanted = AUTO_KV_CONTEXTS * context_blocks * per_block
    if available is None:
        return KVPoolPlan("auto-unknown-memory", context_blocks, wanted_bytes=wanted, **common)
    cap = int(available * AUTO_KV_MEMORY_SHARE)
    blocks = max(1, min(wanted, cap) // per_block)
    return KVPoolPlan("auto", blocks, wanted_bytes=wanted, available_bytes=available, cap_bytes=cap, **common)
