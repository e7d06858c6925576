"""`bench latency` runs every layer on the tiny model and its figures hang together.
(Speed itself is judged by running the benchmark, never by timed tests.)"""
from __future__ import annotations

import pytest

from chatloom.bench.latency import LAYERS, format_table, run_latency
from chatloom.bench.step_breakdown import _Clock


def test_every_layer_serves_the_same_tokens(tiny_model_fp32):
    r = run_latency(tiny_model_fp32, [8, 40], [1, 2], repeats=1, max_tokens=6, breakdown_steps=3)
    assert r["layers"] == list(LAYERS) and len(r["cases"]) == 4
    for case in r["cases"]:
        engine = case["layers"]["engine"]
        assert engine["ttft_overhead_ms"] == 0
        assert engine["requests"] == case["in_flight"]
        for layer in LAYERS:
            s = case["layers"][layer]
            assert s["ttft_ms_p50"] > 0 and s["requests"] == case["in_flight"]
            # Greedy and the same prompt at every layer: the same answer length everywhere.
            assert s["output_tokens_mean"] == engine["output_tokens_mean"]
            if layer != "conversations":  # the app counts its own prompt (same template, same text)
                assert s["prompt_tokens_mean"] == engine["prompt_tokens_mean"]
    b = r["engine_step_breakdown"]["40"]["decode"]
    assert {"matmul", "attention", "layer ops", "sampling"} <= set(b["parts_ms"])
    # The parts are exclusive, so they add up to (at most) the instrumented step.
    assert sum(b["parts_ms"].values()) <= b["instrumented_step_ms"] * 1.05 + 0.05
    assert "engine step, decode" in format_table(r)


def test_clock_counts_children_apart():
    clock = _Clock()
    inner = clock.wrap("inner", lambda: sum(range(20000)))
    outer = clock.wrap("outer", lambda: inner())
    outer()
    assert clock.totals["inner"] > 0 and clock.totals["outer"] >= 0
    assert clock.totals["outer"] < clock.totals["inner"]


def test_unknown_layer_is_refused(tiny_model_fp32):
    with pytest.raises(ValueError, match="unknown layer"):
        run_latency(tiny_model_fp32, [8], [1], layers=["engine", "gpu"])
