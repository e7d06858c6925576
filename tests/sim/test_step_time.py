"""The step-time models: the least-squares fit recovers known coefficients; roofline figures
behave as the hardware does; JSON round trips; bad files give clear errors."""
from __future__ import annotations

import json
import random

import pytest

from chatloom.sim.hardware import roofline_replica, size_node, model_config, gpu
from chatloom.sim.step_time import (BatchShape, LinearStepTime, fit_linear, load_step_time,
                                    step_time_from_dict)


def test_fit_recovers_known_coefficients():
    true = {"const": 0.004, "decode_tokens": 0.0003, "prefill_tokens": 0.00005, "decode_ctx": 2e-7,
            "prefill_attn": 2e-8, "prefill_seqs": 0.0005, "mixed_decode_tokens": 0.0009}
    model = LinearStepTime(coef=true)
    rng = random.Random(1)
    shapes, ys = [], []
    for _ in range(300):
        d = rng.randint(0, 64)
        p = rng.choice([0, 0, rng.randint(1, 512)])
        shape = BatchShape(d, p, d * rng.randint(20, 2000), p * rng.randint(0, 1500), 1 if p else 0, d if p else 0)
        shapes.append(shape)
        ys.append(model.step_time(shape) * (1 + rng.gauss(0, 0.02)))
    fitted = fit_linear(shapes, ys)
    for k, v in true.items():
        assert fitted.coef[k] == pytest.approx(v, rel=0.15, abs=1e-9), k
    assert fitted.fit["median_rel_error"] < 0.03


def test_fit_never_gives_negative_coefficients():
    shapes = [BatchShape(d, 0, d * 100, 0, 0) for d in range(1, 20)]
    # Time falls slightly with context: least squares alone would make decode_ctx negative.
    ys = [0.01 + 0.001 * s.decode_tokens - 1e-7 * s.decode_ctx for s in shapes]
    fitted = fit_linear(shapes, ys)
    assert all(v >= 0 for v in fitted.coef.values())


def test_decode_run_matches_single_steps():
    for model in (LinearStepTime(coef={"const": 0.01, "decode_tokens": 0.001, "prefill_tokens": 0.0,
                                       "decode_ctx": 1e-6, "prefill_attn": 0.0, "prefill_seqs": 0.0}),
                  roofline_replica("llama-70b", "h100", 8).step_time):
        run = model.decode_run(32, 32 * 1000, 10)
        singles = [model.step_time(BatchShape(32, 0, 32 * 1000 + 32 * j, 0, 0)) for j in range(10)]
        assert run.tolist() == pytest.approx(singles)


def test_roofline_70b_on_h100_node():
    spec = roofline_replica("llama-70b", "h100", 8)
    st = spec.step_time
    # Decode at small batch is bandwidth-bound: ~141 GB of weights over 8 x 3.35 TB/s x 0.7.
    t1 = st.step_time(BatchShape(1, 0, 1000, 0, 0))
    assert 0.006 < t1 < 0.015
    # A big batch costs little more than one sequence (the point of batching) ...
    t32 = st.step_time(BatchShape(32, 0, 32 * 1000, 0, 0))
    assert t32 < 1.5 * t1
    # ... while a long prefill is compute-bound and scales with tokens.
    p1 = st.step_time(BatchShape(0, 2048, 0, 2048 * 1024, 1))
    p2 = st.step_time(BatchShape(0, 4096, 0, 4096 * 2048, 1))
    assert p2 > 1.8 * p1
    # KV pool: 8 x 80 GB x 0.9 - 141 GB weights - reserve, at 320 KiB per token.
    assert spec.kv_bytes_per_token == 327680
    assert 1.0e6 < spec.pool_tokens < 1.4e6


def test_fp8_weights_free_memory_and_double_the_peak():
    bf16 = size_node(model_config("llama-70b"), gpu("h100"), 8, "bf16")
    fp8 = size_node(model_config("llama-70b"), gpu("h100"), 8, "fp8")
    assert fp8.weight_bytes == pytest.approx(bf16.weight_bytes / 2)
    assert fp8.tokens > bf16.tokens


def test_json_round_trip(tmp_path):
    for model in (roofline_replica("llama-70b", "a100", 8).step_time,
                  LinearStepTime(coef=dict.fromkeys(["const", "decode_tokens", "prefill_tokens", "decode_ctx",
                                                     "prefill_attn", "prefill_seqs"], 0.001))):
        path = tmp_path / "m.json"
        model.save(path)
        again = load_step_time(path)
        shape = BatchShape(8, 100, 8000, 5000.0, 1)
        assert again.step_time(shape) == pytest.approx(model.step_time(shape))


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_step_time(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_step_time(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="kind must be"):
        step_time_from_dict({"kind": "magic"})
    with pytest.raises(ValueError, match="lacks coefficients"):
        step_time_from_dict({"kind": "linear", "coef": {"const": 1}})
    with pytest.raises(ValueError, match="unknown GPU"):
        roofline_replica("llama-70b", "tpu9", 8)
    with pytest.raises(ValueError, match="does not fit"):
        roofline_replica("llama-70b", "h100", 1)
    with pytest.raises(ValueError, match="unknown model"):
        roofline_replica("llama-9000b", "h100", 8)


def test_a_model_file_without_the_mixed_decode_term_reads_as_zero():
    coef = {"const": 0.01, "decode_tokens": 0.001, "prefill_tokens": 0.0001, "decode_ctx": 0.0, "prefill_attn": 0.0,
            "prefill_seqs": 0.0}
    model = step_time_from_dict({"kind": "linear", "coef": coef})
    assert model.coef["mixed_decode_tokens"] == 0.0
    assert model.step_time(BatchShape(4, 10, 400, 100, 1, 4)) == pytest.approx(0.01 + 0.004 + 0.001)


def test_shape_of_counts_decodes_beside_a_prefill_apart():
    from chatloom.engine import SamplingParams
    from chatloom.engine.scheduler import ScheduledBatch
    from chatloom.engine.sequence import Sequence
    from chatloom.sim.step_time import shape_of

    def seq(computed: int) -> Sequence:
        s = Sequence("s", list(range(computed + 16)), SamplingParams())
        s.num_computed_tokens = computed
        return s

    decode_only = ScheduledBatch(decodes=[seq(10), seq(20)])
    mixed = ScheduledBatch(decodes=[seq(10), seq(20)], prefills=[(seq(32), 11)])
    assert shape_of(decode_only).mixed_decode_tokens == 0
    assert shape_of(mixed) == BatchShape(2, 11, 32, 11 * (32 + 6), 1, 2)
    # At most 12 queries: the engine runs the chunk's tokens as decode queries, at no mixed-step cost.
    short = ScheduledBatch(decodes=[seq(10), seq(20)], prefills=[(seq(32), 10)])
    assert shape_of(short) == BatchShape(2, 10, 32, 10 * (32 + 5.5), 1, 0)


def test_the_fit_keeps_the_spread_of_the_timed_steps_and_jitter_draws_from_it():
    rng = random.Random(2)
    shapes = [BatchShape(d, 0, d * 100, 0, 0) for d in range(1, 41) for _ in range(5)]
    ys = [(0.01 + 0.001 * s.decode_tokens) * rng.uniform(0.8, 1.6) for s in shapes]
    model = fit_linear(shapes, ys)
    q = model.fit["ratio_quantiles"]
    assert len(q) == 20 and q == sorted(q) and 0.7 < q[0] < 0.9 and 1.4 < q[-1] < 1.6
    a, b = model.jitter(random.Random(5), 2000), model.jitter(random.Random(5), 2000)
    assert a == b and set(a) == set(q)  # every slice drawn, nothing else
    assert sum(a) / len(a) == pytest.approx(sum(q) / len(q), rel=0.02)  # each slice as likely
    # It survives a save and load; an exact fit (or a model without a fit) has no spread to draw.
    assert step_time_from_dict(model.to_dict()).jitter(random.Random(5), 3) == a[:3]
    exact = fit_linear(shapes, [0.01 + 0.001 * s.decode_tokens for s in shapes])
    assert exact.jitter(random.Random(5), 3) is None
    assert LinearStepTime(coef=model.coef).jitter(random.Random(5), 3) is None
    with pytest.raises(ValueError, match="ratio_quantiles"):
        LinearStepTime(coef=model.coef, fit={"ratio_quantiles": [1.2, 0.9]})
