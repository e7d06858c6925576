"""The paged-attention kernel on a decode step's shape, against a plain read of memory.

A decode step of `sequences` sequences reads every layer's cached K and V once. Two layouts, each
timed with the kernel's AVX-512 path (where the CPU has it) and its AVX2 path, called in turn:
- scattered: each layer's blocks lie anywhere in pools the size of a real step's (what the engine
  sees once the pools outgrow the caches);
- cached: every layer reuses the same blocks, so the pools stay in cache and only the arithmetic
  counts.
The baseline, measured in the same run: summing a buffer of as many bytes as the scattered step
reads (a plain streaming read on the same threads), so `fraction_of_plain_read` says how close the
kernel comes to this machine's memory bandwidth.
"""
from __future__ import annotations

import random

import torch

from chatloom.bench.kquant_matmul import interleaved_medians
from chatloom.engine.config import KV_CACHE_DTYPES

BLOCK_SIZE = 16


def _tables(num_layers: int, lens: list[int], shared: bool, seed: int) -> tuple[list[torch.Tensor], int]:
    """Per-layer block tables [sequences, blocks] over one shuffled pool, and the pool's block count."""
    per_seq = [-(-n // BLOCK_SIZE) for n in lens]
    width = max(per_seq)
    per_layer = sum(per_seq)
    num_blocks = per_layer * (1 if shared else num_layers)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    tables = []
    for layer in range(num_layers):
        base = 0 if shared else layer * per_layer
        rows, at = [], base
        for n in per_seq:
            rows.append(order[at:at + n] + [0] * (width - n))
            at += n
        tables.append(torch.tensor(rows, dtype=torch.int32))
    return tables, num_blocks


def run_attention(sequences: int, positions: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                  kv_dtype: str = "fp32", seconds: float = 0.5, seed: int = 0) -> dict:
    from chatloom.models.kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        raise ValueError("the C++ kernels are unavailable (no compiler, or CHATLOOM_RUNTIME__KERNELS=0)")
    if heads % kv_heads:
        raise ValueError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {kv_dtype!r} (known: {', '.join(KV_CACHE_DTYPES)})")
    dtype = KV_CACHE_DTYPES[kv_dtype]
    rng = random.Random(seed)
    # Sequences of different lengths, as in a real batch: up to 100 positions under the longest.
    lens = [rng.randint(max(1, positions - 100), positions) for _ in range(sequences)]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sequences, heads, head_dim, generator=gen)
    rows = torch.arange(sequences, dtype=torch.int32)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    paths = kernels.paged_attention_isas()
    elem = torch.empty(0, dtype=dtype).element_size()
    step_bytes = sum(lens) * layers * 2 * kv_heads * head_dim * elem

    layouts = {}
    for layout in ("scattered", "cached"):
        tables, num_blocks = _tables(layers, lens, layout == "cached", seed)
        shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        k_pool = torch.randn(shape, generator=gen).to(dtype)
        v_pool = torch.randn(shape, generator=gen).to(dtype)

        def step(path: str) -> None:
            for table in tables:
                kernels.paged_attention(q, k_pool, v_pool, table, rows, kv_lens, scale, path)

        times = interleaved_medians({path: (lambda p=path: step(p)) for path in paths}, seconds)
        layouts[layout] = {
            "pool_blocks": num_blocks,
            "pool_mb": round(2 * k_pool.numel() * elem / 2**20, 1),
            "by_path": {p: {"ms_per_step": ms, "gb_per_s": round(step_bytes / (ms * 1e-3) / 1e9, 2)}
                        for p, ms in times.items()},
        }
        del k_pool, v_pool

    # The baseline: one plain read of as many bytes as a scattered step reads.
    buffer = torch.randn(max(1, step_bytes // 4), generator=gen)
    read_ms = interleaved_medians({"read": lambda: buffer.sum()}, seconds)["read"]
    read_gbps = round(buffer.numel() * 4 / (read_ms * 1e-3) / 1e9, 2)
    best = max(v["gb_per_s"] for v in layouts["scattered"]["by_path"].values())
    return {"benchmark": "attention", "sequences": sequences, "kv_lens": [min(lens), max(lens)], "layers": layers,
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "kv_cache_dtype": kv_dtype,
            "threads": torch.get_num_threads(), "step_mb": round(step_bytes / 2**20, 1), "layouts": layouts,
            "plain_read": {"ms": read_ms, "gb_per_s": read_gbps},
            "fraction_of_plain_read": round(best / read_gbps, 2)}
