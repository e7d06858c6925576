"""Cost per million output tokens from the fitted step-time model."""
from __future__ import annotations

import pytest

from chatloom.sim.arrivals import TrafficModel
from chatloom.sim.cost import cost_report, replica_seconds_per_request, slo_batch
from chatloom.sim.hardware import ReplicaSpec
from chatloom.sim.step_time import LinearStepTime

# 10 ms a step plus 1 ms per sequence; prefill 0.1 ms a token.
STEP = LinearStepTime(coef={"const": 0.01, "decode_tokens": 0.001, "prefill_tokens": 0.0001, "decode_ctx": 0.0,
                            "prefill_attn": 0.0, "prefill_seqs": 0.0})
SPEC = ReplicaSpec(num_blocks=100_000, step_time=STEP, max_num_seqs=256, gpus=2)
TRAFFIC = TrafficModel(peak_rate=10.0, system_prompt_tokens=100, mean_turns=1.0, user_median_tokens=100,
                       answer_median_tokens=200, answer_sigma=0.0, reasoning_share=0.0)


def test_the_slo_batch_is_the_largest_whose_step_meets_the_tpot_target():
    # step(b) = 10 + b ms: 50 ms allows 40 sequences.
    assert slo_batch(SPEC, TRAFFIC, 0.050) == 40
    assert slo_batch(SPEC, TRAFFIC, 0.001) == 1  # nothing meets it: one sequence at a time


def test_cost_per_million_tokens_follows_the_step_model():
    answer = TRAFFIC.mean_answer_tokens
    prompt = 100 + (100 + answer) / 2
    seconds = replica_seconds_per_request(SPEC, TRAFFIC, 40, 0.5)
    assert seconds == pytest.approx(answer * 0.050 / 40 + 0.0001 * int(prompt / 2))
    report = cost_report(SPEC, TRAFFIC, replicas=3, gpu_hour_price=2.0, tpot_s=0.050, prefix_hit=0.5)
    assert report["fleet_cost_per_hour"] == 12.0
    # Two GPUs at 2.0 an hour: 4.0 per replica-hour over the replica-seconds each output token takes.
    assert report["per_million_output_tokens_at_slo"] == pytest.approx(4.0 / 3600 * seconds / answer * 1e6, rel=1e-3)
    assert report["per_million_output_tokens_at_planned_load"] == pytest.approx(
        12.0 / (10.0 * answer * 3600) * 1e6, rel=1e-3)
    prefill = 0.0001 * int(prompt / 2)
    assert report["batching_saving"] == pytest.approx(1 - seconds / (answer * 0.011 + prefill), abs=1e-4)
    assert 0 < report["prefix_caching_saving"] < 0.5
