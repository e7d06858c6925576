"""Speed of the quantized matmul kernels, type by type, against the float32 kernel.

For each GGUF type the kernels keep quantized, a random weight [n, k] in that type (valid
blocks: random codes and scales) is multiplied by x [rows, k] three ways in one process:
the float32 packed kernel on the dequantized weight (the baseline: what dequantizing at load
gives), the exact quantized kernel (the same bits) and the int8-activation kernel, called in
turn; times are medians, ratios are against the float32 baseline measured alongside.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

KINDS = ("Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q8_0")


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF blocks [rows, bytes per row] of `kind` with random codes and finite scales
    sized for weights of about 0.1 (gguf's Python package cannot make K-quants)."""
    rng = np.random.default_rng(seed)

    def f16(lo: float, hi: float, nb: int) -> np.ndarray:
        return rng.uniform(lo, hi, (rows, nb, 1)).astype(np.float16).view(np.uint8)

    def raw(n: int, nb: int) -> np.ndarray:
        return rng.integers(0, 256, (rows, nb, n), dtype=np.uint8)

    nb = cols // 256
    if kind == "Q4_K":
        parts = [f16(0.00005, 0.0002, nb), f16(0.0, 0.0001, nb), raw(12, nb), raw(128, nb)]
    elif kind == "Q5_K":
        parts = [f16(0.00003, 0.0001, nb), f16(0.0, 0.0001, nb), raw(12, nb), raw(32, nb), raw(128, nb)]
    elif kind == "Q6_K":
        scales = rng.integers(-128, 128, (rows, nb, 16), dtype=np.int8).view(np.uint8)
        parts = [raw(128, nb), raw(64, nb), scales, f16(-0.00003, 0.00003, nb)]
    elif kind == "Q4_1":
        nb = cols // 32
        parts = [f16(0.005, 0.02, nb), f16(-0.1, 0.0, nb), raw(16, nb)]
    elif kind == "Q8_0":
        nb = cols // 32
        parts = [f16(0.0005, 0.002, nb), raw(32, nb)]
    else:
        raise ValueError(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def interleaved_medians(fns: dict, seconds: float) -> dict[str, float]:
    """Median milliseconds of each function, called in turn until `seconds` have passed for
    all of them together: noise on a shared machine lands on every mode alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm up
    end = time.perf_counter() + seconds * len(fns)
    while time.perf_counter() < end or min(len(v) for v in samples.values()) < 3:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: round(statistics.median(v) * 1e3, 3) for name, v in samples.items()}


def run_kquant_matmul(kinds: list[str], k: int, n: int, rows: list[int], seconds: float = 0.5) -> dict:
    from chatloom.models.kernels import load_kernels
    from chatloom.models.packed_linear import (QuantizedLinear, QuantizedWeight, int8_matmul_supported,
                                               pack_quantized, pack_weight)

    kernels = load_kernels()
    if kernels is None:
        raise ValueError("the C++ kernels are unavailable (no compiler, or CHATLOOM_RUNTIME__KERNELS=0)")
    if k % 256:
        raise ValueError(f"k must be a multiple of 256 (K-quant super-blocks), got {k}")
    int8 = int8_matmul_supported(kernels)
    out: dict[str, dict] = {}
    for kind in kinds:
        part = QuantizedWeight(kind, random_blocks(kind, n, k), n, k)
        codes, scales = pack_quantized([part])
        exact = QuantizedLinear(codes, scales, n, None, kernels)
        fast = QuantizedLinear(codes, scales, n, None, kernels, int8_activations=True) if int8 else None
        dense = pack_weight(exact.weight)
        per_rows = {}
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            fns = {"float32_ms": lambda: kernels.packed_linear(x, dense, n), "exact_ms": lambda: exact(x)}
            if fast is not None:
                fns["int8_ms"] = lambda: fast(x)
            row = interleaved_medians(fns, seconds)
            base = row["float32_ms"]
            row["exact_speedup"] = round(base / row["exact_ms"], 2)
            if fast is not None:
                row["int8_speedup"] = round(base / row["int8_ms"], 2)
            per_rows[str(m)] = row
        weight_bytes = codes.numel() * codes.element_size() + scales.numel() * 4
        out[kind] = {"bytes_per_weight": round(weight_bytes / (n * k), 3), "by_rows": per_rows}
    return {"benchmark": "kquant-matmul", "k": k, "n": n, "threads": torch.get_num_threads(),
            "int8_supported": int8, "kinds": out}
