"""Speed of the quantized matmul kernels, type by type, against the float32 kernel.

For each GGUF type the kernels keep quantized, a random weight [n, k] in that type (valid
blocks: random codes and scales) is multiplied by x [rows, k] in one process: the float32
packed kernel on the dequantized weight (the baseline: what dequantizing at load gives), the
exact quantized kernel in the group-scale layout (the same bits), for Q4_K and Q6_K the exact
kernel on the file's super-blocks (kquant_panels.py; the same bits again), the
int8-activation kernel in the group-scale layout and, for Q4_K and Q6_K with AVX-512 VNNI, on the
super-blocks (superblock_int8), called in turn; times are medians, ratios are against the float32
baseline measured alongside. With `layers` > 1 each kernel cycles through that many weights of
the shape (as a decode step does through its layers), so that they come from memory rather than
the caches; `gb_per_s` is then each layout's bytes over its time. With `cpu_time` (one thread) each
call is timed by the calling thread's CPU time rather than the wall clock: the kernels then run on
that thread, and on a machine shared with other work the time it waited for a core does not count
(the time it waited for memory does).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

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


def interleaved_medians(fns: dict, seconds: float, clock: Callable[[], float] = time.perf_counter
                        ) -> dict[str, float]:
    """Median milliseconds of each function by `clock`, called in turn until `seconds` have passed
    for all of them together: noise on a shared machine lands on every mode alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm up
    end = time.perf_counter() + seconds * len(fns)
    while time.perf_counter() < end or min(len(v) for v in samples.values()) < 3:
        for name, fn in fns.items():
            t0 = clock()
            fn()
            samples[name].append(clock() - t0)
    return {name: round(statistics.median(v) * 1e3, 3) for name, v in samples.items()}


def _nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.buffers() if t is not None)


def run_kquant_matmul(kinds: list[str], k: int, n: int, rows: list[int], seconds: float = 0.5,
                      layers: int = 1, cpu_time: bool = False) -> dict:
    from chatloom.models.kernels import load_kernels
    from chatloom.models.kquant_panels import PANEL_KINDS
    from chatloom.models.packed_linear import (KQuantLinear, QuantizedLinear, QuantizedWeight, int8_matmul_supported,
                                               kquant_int8_supported, kquant_matmul_supported, pack_quantized,
                                               pack_weight)

    kernels = load_kernels()
    if kernels is None:
        raise ValueError("the C++ kernels are unavailable (no compiler, or CHATLOOM_RUNTIME__KERNELS=0)")
    if k % 256:
        raise ValueError(f"k must be a multiple of 256 (K-quant super-blocks), got {k}")
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    if cpu_time and torch.get_num_threads() != 1:
        raise ValueError("CPU time measures the calling thread only: run it on one thread (--threads 1)")
    clock = time.thread_time if cpu_time else time.perf_counter
    int8 = int8_matmul_supported(kernels)
    out: dict[str, dict] = {}
    for kind in kinds:
        parts = [QuantizedWeight(kind, random_blocks(kind, n, k, seed), n, k) for seed in range(layers)]
        packed = [pack_quantized([part]) for part in parts]
        modes = {"float32": [], "exact": []}
        for part, (codes, scales) in zip(parts, packed):
            exact = QuantizedLinear(codes, scales, n, None, kernels)
            modes["exact"].append(exact)
            dense = pack_weight(exact.weight)
            modes["float32"].append(lambda x, dense=dense: kernels.packed_linear(x, dense, n))
            if kind in PANEL_KINDS and kquant_matmul_supported(kernels):
                modes.setdefault("superblock", []).append(KQuantLinear.from_parts([part], n, None, kernels))
            if int8:
                modes.setdefault("int8", []).append(QuantizedLinear(codes, scales, n, None, kernels,
                                                                    int8_activations=True))
            if kind in PANEL_KINDS and kquant_int8_supported(kernels):
                modes.setdefault("superblock_int8", []).append(
                    KQuantLinear.from_parts([part], n, None, kernels, int8_activations=True))
        weight_bytes = {"float32": 4 * n * k, "exact": _nbytes(modes["exact"][0])}
        for mode in ("superblock", "superblock_int8", "int8"):
            if mode in modes:
                weight_bytes[mode] = _nbytes(modes[mode][0])
        per_rows = {}
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))

            def cycle(fns: list) -> callable:
                turn = iter(range(10**12))
                return lambda: fns[next(turn) % len(fns)](x)

            row = interleaved_medians({f"{mode}_ms": cycle(fns) for mode, fns in modes.items()}, seconds, clock)
            base = row["float32_ms"]
            for mode in modes:
                if mode != "float32":
                    row[f"{mode}_speedup"] = round(base / row[f"{mode}_ms"], 2)
            for mode, nbytes in weight_bytes.items():
                row[f"{mode}_gb_per_s"] = round(nbytes / (row[f"{mode}_ms"] * 1e-3) / 1e9, 1)
            per_rows[str(m)] = row
        out[kind] = {"bytes_per_weight": round(weight_bytes["exact"] / (n * k), 3),
                     **({"superblock_bytes_per_weight": round(weight_bytes["superblock"] / (n * k), 4)}
                        if "superblock" in weight_bytes else {}),
                     "by_rows": per_rows}
    return {"benchmark": "kquant-matmul", "k": k, "n": n, "layers": layers, "threads": torch.get_num_threads(),
            "clock": "thread CPU time" if cpu_time else "wall", "int8_supported": int8, "kinds": out}
