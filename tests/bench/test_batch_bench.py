"""`chatloom bench batch` in its short mode: the JSON's shape, and every phase ran (timing is not checked)."""
from __future__ import annotations

from chatloom.bench.batch import format_table, run_batch_bench
from chatloom.engine import EngineConfig


def test_the_batch_bench_runs_every_phase(tiny_model_fp32):
    result = run_batch_bench(tiny_model_fp32, requests=6, users=2, turns=2, max_tokens=4, batch_max_tokens=4,
                             think_s=0.0, engine_config=EngineConfig(num_blocks=256, max_num_seqs=8), rounds=2)
    alone, together = result["interactive_alone"], result["together"]
    # The random model's answer is now and then no visible text (no first token to time): no other failure.
    for phase in (alone, together["interactive"]):
        assert set(phase["errors"]) <= {"no_output"} and phase["failed"] < phase["requests"], phase
    assert alone["requests"] == 8 and alone["ttft_ms"]["p90"] > 0
    assert together["interactive"]["requests"] >= 8
    for batch in (result["batch_alone"], together["batch"]):
        assert (batch["status"], batch["completed"], batch["failed"]) == ("completed", 6, 0)
        assert 0 < batch["output_tokens"] <= 6 * 4 and batch["output_tokens_per_s"] > 0
    assert set(result) >= {"idle_capacity_tokens_per_s", "ttft_p90_ratio", "batch_share_of_idle", "targets"}
    assert set(result["targets"]) == {"ttft_p90_ratio_max", "batch_share_of_idle_min", "met"}
    # Engine time: the users' phases ran steps with their sequences in them; the batch alone ran only batch
    # steps, and beside the users its steps and theirs fit in the phase's time.
    e = result["engine_time"]
    assert 0 < e["interactive_alone_foreground_share"] <= 1 and 0 < e["together_foreground_share"] <= 1
    alone_engine = result["batch_alone"]["engine_seconds"]
    assert alone_engine["background"] > 0 and alone_engine["background"] <= alone_engine["wall"]
    together_engine = together["batch"]["engine_seconds"]
    busy = together_engine["foreground"] + together_engine["background"] + together_engine["interrupted"]
    assert together_engine["background"] > 0 and busy <= together_engine["wall"]
    assert e["batch_share_of_time_left"] > 0
    assert "TTFT p90 ratio" in format_table(result) and "time left" in format_table(result)
