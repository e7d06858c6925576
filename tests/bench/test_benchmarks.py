"""The benchmarks run end to end on the tiny model and report consistent figures.
(Speed itself is checked by running them, never by timed tests.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from chatloom.bench.memory import run_memory
from chatloom.bench.prefix import run_prefix
from chatloom.bench.throughput import run_mode
from chatloom.bench.workload import standard_workload


def test_standard_workload_is_seeded_and_in_range():
    a = standard_workload(20, 49152, seed=3)
    b = standard_workload(20, 49152, seed=3)
    assert a == b and a != standard_workload(20, 49152, seed=4)
    assert all(32 <= len(r.prompt_token_ids) <= 256 and 32 <= r.output_len <= 256 for r in a)


def test_throughput_modes_produce_every_requested_token(tiny_model_fp32):
    reqs = standard_workload(6, tiny_model_fp32.config.vocab_size, seed=1, prompt_range=(4, 20),
                             output_range=(3, 12))
    for mode in ("continuous", "static", "sequential"):
        r = run_mode(mode, tiny_model_fp32, reqs, static_batch_size=4)
        assert r["mode"] == mode and r["requests"] == 6
        assert r["output_tokens"] == sum(x.output_len for x in reqs)
        assert r["output_tokens_per_s"] > 0 and r["seconds"] > 0


def test_paged_memory_holds_real_tokens(tiny_model_fp32):
    reqs = standard_workload(16, tiny_model_fp32.config.vocab_size, seed=2, output_range=(8, 24))
    r = run_memory(tiny_model_fp32, reqs)
    assert r["paged_utilization"] >= 0.9
    assert r["contiguous_max_len_utilization"] < 0.2


def test_prefix_cache_cuts_later_turn_work(tiny_model_fp32):
    r = run_prefix(tiny_model_fp32, turns=3, max_tokens=4, conversations=1)
    assert r["cache_on"]["hit_rate"] > 0.5
    assert r["cache_off"]["hit_rate"] == 0
    assert len(r["cache_on"]["ttft_ms_per_turn"]) == 3


def test_bench_cli_prints_json():
    proc = subprocess.run([sys.executable, "-m", "chatloom.cli", "bench", "memory", "--model", "tiny-random",
                           "--num-requests", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["benchmark"] == "memory" and 0 < data["paged_utilization"] <= 1


def test_bench_cli_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "chatloom.cli", "bench", "throughput", "--num-requests", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "num-requests" in proc.stderr


def test_int8_flag_reaches_the_model_and_the_report():
    """--int8-matmul only changes 4-bit GGUF layers: the tiny float model reports it unused."""
    proc = subprocess.run([sys.executable, "-m", "chatloom.cli", "bench", "throughput", "--model", "tiny-random",
                           "--num-requests", "2", "--int8-matmul"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["mode"] == "continuous" and data["int8_matmul"] is False


def test_int8_roofline_measures_the_kernel():
    from chatloom.bench.roofline import int8_kernel_matmul_gflops
    from chatloom.models.kernels import load_kernels
    from chatloom.models.packed_linear import QuantizedLinear, int8_matmul_supported

    kernels = load_kernels()
    if not int8_matmul_supported(kernels):
        pytest.skip("int8 matmul kernel unavailable on this CPU")
    codes = torch.randint(0, 256, (2, 64, 8), dtype=torch.uint8)
    layer = QuantizedLinear(codes, torch.rand(2, 2, 2, 16), 32, None, kernels, int8_activations=True)
    assert int8_kernel_matmul_gflops(layer, 8, seconds=0.01) > 0


def test_spec_bench_reports_on_and_off(tiny_model):
    """Structure and consistency only (speed is what the command is run for): on the
    float64 tiny model, speculation changes no output token."""
    from chatloom.bench.spec import run_spec

    result = run_spec(tiny_model, batch_sizes=(1, 2), max_tokens=12, num_prompts=2, k=3,
                      draft="self-layers:1", adaptive=False)
    assert [(r["workload"], r["batch"]) for r in result["results"]] == [
        ("repeating", 1), ("repeating", 2), ("mixed", 1), ("mixed", 2), ("chat", 1), ("chat", 2)]
    for r in result["results"]:
        assert r["identical_outputs"] == r["prompts"] == 2 and r["draft"]["identical_outputs"] == 2
        assert r["output_tokens"]["off"] == r["output_tokens"]["ngram"] > 0
        assert r["speedup"] > 0 and r["draft"]["draft_tokens"] > 0
        assert r["tpot_ms"]["off"] > 0 and r["tpot_ms"]["ngram"] > 0
        assert r["tpot_speedup"] == round(r["tpot_ms"]["off"] / r["tpot_ms"]["ngram"], 3)
        assert 0.0 <= r["repeat_fraction"] <= 1.0
    assert all(r["draft_tokens"] > 0 for r in result["results"] if r["workload"] == "repeating")
    assert set(result["targets_met"]) == {"repeating_batch1_at_least_1.5x", "never_below_0.95x_elsewhere"}


def test_repeat_fraction_counts_copied_tokens():
    from chatloom.bench.spec import repeat_fraction

    prompt = [1, 2, 3, 4, 5, 6]
    assert repeat_fraction([prompt], [[2, 3, 4, 5]]) == 1.0
    assert repeat_fraction([prompt], [[9, 8, 7, 6]]) == 0.0
    # [3, 4, 5] is copied, 9 and 7 are not; the second answer copies nothing.
    assert repeat_fraction([prompt, prompt], [[9, 3, 4, 5, 7], [7, 7, 7]]) == 0.375
    assert repeat_fraction([prompt], [[]]) == 0.0


def test_spec_bench_rejects_a_bad_draft_model():
    proc = subprocess.run([sys.executable, "-m", "chatloom.cli", "bench", "spec", "--model", "tiny-random",
                           "--speculative-model", "self-layers:99", "--max-tokens", "2", "--num-prompts", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "self-layers:99" in proc.stderr
