"""This machine's matmul throughput at the engine's batch sizes, and the engine's
achieved FLOP/s (about 2 x parameters x tokens/s) as a fraction of it.

With the kernels built, it also measures this CPU's peak per instruction set (independent
chains of one multiply-add instruction on every thread: float32 FMA on AVX2 and AVX-512,
int8 vpmaddubsw and vpdpbusd, bf16 vdpbf16ps) and runs the int8 matmul on each instruction
path this CPU has, so each path's GFLOP/s stands against its own instruction's peak."""
from __future__ import annotations

import time

import torch

from chatloom.bench.throughput import run_continuous
from chatloom.bench.workload import standard_workload
from chatloom.models.loader import LoadedModel
from chatloom.models.packed_linear import QUANT_BLOCK, QuantizedLinear


def _gflops(run, flops: float, seconds: float) -> float:
    """GFLOP/s of `run()` (which does `flops` of work), timed for about `seconds` after a warm-up."""
    for _ in range(3):
        run()
    runs, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        run()
        runs += 1
    return flops * runs / (time.perf_counter() - t0) / 1e9


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, seconds: float = 0.5) -> float:
    """GFLOP/s of W[n, k] @ x[k, m] in PyTorch."""
    w = torch.randn(n, k, dtype=dtype)
    x = torch.randn(k, m, dtype=dtype)
    return _gflops(lambda: torch.mm(w, x), 2 * m * k * n, seconds)


def kernel_matmul_gflops(m: int, k: int, n: int, seconds: float = 0.5, isa: str = "auto") -> float | None:
    """GFLOP/s of chatloom's packed-weight float32 kernel on x[m, k] @ W[n, k]^T (None without it)."""
    from chatloom.models.kernels import load_kernels
    from chatloom.models.packed_linear import pack_weight

    kernels = load_kernels()
    if kernels is None:
        return None
    packed, x = pack_weight(torch.randn(n, k)), torch.randn(m, k)
    return _gflops(lambda: kernels.packed_linear(x, packed, n, None, isa), 2 * m * k * n, seconds)


def bf16_kernel_matmul_gflops(m: int, k: int, n: int, seconds: float = 0.5, isa: str = "auto") -> float:
    """GFLOP/s of the bfloat16-weight kernel on x[m, k] @ W[n, k]^T."""
    from chatloom.models.kernels import load_kernels
    from chatloom.models.packed_linear import pack_bf16

    kernels = load_kernels()
    packed, x = pack_bf16(torch.randn(n, k)), torch.randn(m, k)
    return _gflops(lambda: kernels.bf16_linear(x, packed, n, None, isa), 2 * m * k * n, seconds)


def int8_kernel_matmul_gflops(layer: QuantizedLinear, m: int, seconds: float = 0.5, isa: str = "auto") -> float:
    """Effective GFLOP/s (2mkn per second) of the int8-activation kernel on one of the
    model's own int8 layers, x[m, k] @ W[n, k]^T, on instruction path `isa`."""
    x = torch.randn(m, layer.in_features)
    kernel = layer._kernels.int8_linear  # called directly, like the float kernel above
    return _gflops(lambda: kernel(x, layer.codes, layer.scales, layer.out_features, None, isa),
                   2 * m * layer.in_features * layer.out_features, seconds)


# Which measured peak each kernel path stands against.
PEAK_FOR_PATH = {"fp32 avx2": "fp32_avx2_fma", "fp32 avx512": "fp32_avx512_fma", "int8 avx2": "int8_avx2_maddubs",
                 "int8 avx512_vnni": "int8_avx512_vnni", "bf16 avx512_bf16": "bf16_avx512_dot"}


def isa_peaks(kernels, iters: int = 3_000_000) -> dict[str, float]:
    """Measured GOP/s per instruction kind this CPU has (best of three)."""
    return {kind: round(max(kernels.peak_gops(kind, iters) for _ in range(3)), 1) for kind in kernels.peak_kinds()}


def read_bandwidth_gbps(mib: int = 512, repeats: int = 12, pause_s: float = 0.05) -> float:
    """This machine's streaming read bandwidth in GB/s: the best of `repeats` sums over a float32 buffer
    of `mib` MiB (far larger than the caches), on torch's threads. A decode step at batch 1 reads every
    weight once, so weight bytes over this is the fastest a step can be (the memory roofline).

    The sums are spread out by `pause_s`: a sum during which the OS lends one of the cores to another
    process reads at one core's rate (about half, on a 2-core machine), and a burst of back-to-back sums
    can fall entirely inside such a spell."""
    buffer = torch.ones(mib * 2**20 // 4)
    buffer.sum()  # first touch: page faults, not reads
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - t0)
        time.sleep(pause_s)
    return round(buffer.numel() * 4 / best / 1e9, 2)


def run_roofline(loaded: LoadedModel, num_requests: int = 32, seed: int = 0,
                 batch_sizes: tuple[int, ...] = (1, 8, 32, 64, 128, 512)) -> dict:
    cfg = loaded.config
    k, n = cfg.hidden_size, 2 * cfg.intermediate_size  # the MLP's fused gate/up: the biggest per-layer matmul
    peak = {m: round(matmul_gflops(m, k, n, loaded.dtype), 1) for m in batch_sizes}
    ours, int8, int8_by_isa, peaks, vs_peak, kernel_by_path = {}, {}, {}, {}, {}, {}
    if loaded.dtype == torch.float32:
        ours = {m: round(g, 1) for m in batch_sizes if (g := kernel_matmul_gflops(m, k, n)) is not None}
        gate_up = loaded.model.layers[0].mlp.gate_up_proj  # the same [k, n] matmul, as the engine runs it
        # int8_linear's layout only (a scale per 32); the grouped K-quant layout has its own kernel
        if isinstance(gate_up, QuantizedLinear) and gate_up.int8_activations and gate_up.group == QUANT_BLOCK:
            int8 = {m: round(int8_kernel_matmul_gflops(gate_up, m), 1) for m in batch_sizes}
            int8_by_isa = {isa: {m: round(int8_kernel_matmul_gflops(gate_up, m, isa=isa), 1) for m in batch_sizes}
                           for isa in gate_up._kernels.int8_linear_isas() if isa != "scalar"}
        from chatloom.models.kernels import load_kernels

        kernels = load_kernels()
        if kernels is not None and hasattr(kernels, "peak_gops"):
            peaks = isa_peaks(kernels)
            paths = {f"fp32 {isa}": {m: round(kernel_matmul_gflops(m, k, n, isa=isa), 1) for m in batch_sizes}
                     for isa in kernels.float_linear_isas()}
            paths.update({f"int8 {isa}": g for isa, g in int8_by_isa.items()})
            paths.update({f"bf16 {isa}": {m: round(bf16_kernel_matmul_gflops(m, k, n, isa=isa), 1)
                                          for m in batch_sizes}
                          for isa in kernels.bf16_linear_isas() if isa != "scalar"})
            kernel_by_path = paths
            vs_peak = {path: {"best_gflops": max(g.values()), "peak_gops": peaks[PEAK_FOR_PATH[path]],
                              "fraction": round(max(g.values()) / peaks[PEAK_FOR_PATH[path]], 3)}
                       for path, g in paths.items() if g and PEAK_FOR_PATH.get(path) in peaks}
    requests = standard_workload(num_requests, cfg.vocab_size, seed)
    run = run_continuous(loaded, requests, max_num_seqs=64)
    params = cfg.num_parameters()
    # Every computed token (prompt and output) costs about 2 x parameters FLOPs.
    tokens = run["output_tokens"] + run["prompt_tokens"]
    achieved = 2 * params * tokens / run["seconds"] / 1e9
    # The denominator is the best matmul this machine ran, by any implementation the engine uses.
    best = max([*peak.values(), *ours.values(), *int8.values()])
    return {"benchmark": "roofline", "matmul_shape_k_n": [k, n], "matmul_gflops_by_batch": peak,
            "kernel_matmul_gflops_by_batch": ours,
            **({"int8_kernel_matmul_gflops_by_batch": int8} if int8 else {}),
            **({"isa_peak_gops": peaks, "kernel_gflops_by_path": kernel_by_path, "kernel_vs_isa_peak": vs_peak}
               if peaks else {}),
            "parameters": params, "engine_tokens_per_s": round(tokens / run["seconds"], 1),
            "engine_output_tokens_per_s": run["output_tokens_per_s"],
            "engine_gflops": round(achieved, 1), "fraction_of_best_matmul": round(achieved / best, 3),
            "read_bandwidth_gbps": read_bandwidth_gbps()}
