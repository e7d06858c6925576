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


def test_team_breakdown_splits_a_decode_step(tmp_path, monkeypatch):
    """Decode steps on the decode team: the team's profile per part, each matmul with its weights and
    their rate, inside the native call's time, and the rest of the step outside it."""
    import sys
    from pathlib import Path

    from chatloom.bench.step_breakdown import team_breakdown
    from chatloom.engine import EngineConfig
    from chatloom.engine.llm_engine import LLMEngine
    from chatloom.models import load_model
    from chatloom.models.kernels import load_kernels

    if load_kernels() is None:
        pytest.skip("C++ kernels unavailable")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import tiny_checkpoints as tc

    monkeypatch.setitem(tc.KQUANT_MIX, "attn_output", "Q4_K")  # every matmul Q4_K or Q6_K: the team's kinds
    cfg = tc.hf_config("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64)
    tc.write_kquant_gguf(tmp_path / "kq.gguf", cfg, seed=2)
    loaded = load_model(str(tmp_path / "kq.gguf"), "fp32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=32, block_size=4))
    stack = loaded.model.decode_stack()
    if stack is None or not stack.team_path:
        pytest.skip("no decode team on this CPU")
    b = team_breakdown(engine, list(range(3, 20)), 4)
    assert b["steps"] == 4
    parts = b["parts"]
    assert {"qkv", "attention", "o", "gate_up", "down"} <= set(parts)
    layers = loaded.model.layers
    down_mb = sum(layer.mlp.down_proj.blob.numel() for layer in layers) / 1e6
    assert abs(parts["down"]["weights_mb"] - down_mb) <= 0.05 + 0.01 * down_mb
    assert parts["gate_up"]["gb_per_s"] > 0 and "weights_mb" not in parts["attention"]
    if stack.has_head:
        assert parts["head"]["ms"] > 0
    assert 0 < b["team_ms"] <= b["native_call_ms"] and b["outside_native_ms"] >= 0
    assert "decode_tokens" not in vars(loaded.model)  # the timers are gone again
