"""`chatloom sim` and `chatloom plan` end to end on tiny fleets, with the serving room's routing policies,
and their bad inputs."""
from __future__ import annotations

import argparse
import json

import pytest

from chatloom.cli.main import main
from chatloom.sim.step_time import LinearStepTime


def small_step_time(tmp_path):
    path = tmp_path / "st.json"
    LinearStepTime(coef={"const": 0.01, "decode_tokens": 0.0005, "prefill_tokens": 0.0001, "decode_ctx": 1e-7,
                         "prefill_attn": 1e-9, "prefill_seqs": 0.0002}).save(path)
    return str(path)


SMALL = ["--kv-blocks", "400", "--max-num-seqs", "16", "--answer-median-tokens", "40", "--user-median-tokens", "30",
         "--system-prompt-tokens", "32", "--reasoning-median-tokens", "200", "--think-time", "2"]


def test_sim_prints_figures_per_policy_and_fleet_size_and_plots(tmp_path, capsys):
    rc = main(["sim", "--step-time", small_step_time(tmp_path), *SMALL, "--rate", "4", "--replicas", "2", "3",
                   "--policy", "prefix_aware", "least_load", "--duration", "20", "--disagg", "1:2",
                   "--load-factors", "0.5", "1", "--plot", str(tmp_path / "plots")])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    runs = out["runs"]
    assert {(r["policy"], r["replicas"], r["load_factor"]) for r in runs if r["mode"] == "colocated"} == {
        (p, n, f) for p in ("prefix_aware", "least_load") for n in (2, 3) for f in (0.5, 1.0)}
    dis = [r for r in runs if r["mode"] == "disaggregated"]
    assert len(dis) == 2 and all(r["kv_transfers"] > 0 for r in dis)
    for r in runs:
        assert r["completed"] + r["refused"] + r["unfinished"] == r["requests"]
        assert r["ttft_ms"]["p50"] is not None and 0 <= r["prefix_hit_rate"] <= 1
    assert (tmp_path / "plots" / "latency_vs_load.png").stat().st_size > 10_000


def test_plan_prints_the_seeds_beside_the_simulated_fleet(tmp_path, capsys):
    rc = main(["plan", "--step-time", small_step_time(tmp_path), *SMALL, "--rate", "10", "--duration", "30",
                   "--slo-ttft-ms", "500", "--attainment", "0.9", "--cell-size", "4",
                   "--plot", str(tmp_path), "--plot-fractions", "0.5", "1"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "seeds back-of-envelope" in text and "servers for 2.5 M tokens/s" in text
    assert "simulated:" in text and "why the simulated fleet differs" in text
    assert (tmp_path / "replicas_vs_peak.png").stat().st_size > 10_000


def test_plan_json_for_the_70b_on_h100_roofline(capsys):
    rc = main(["plan", "--model", "llama-70b", "--gpu", "h100", "--peak-tokens-per-s", "3e4", "--duration", "40",
                   "--cell-size", "4", "--json", "--tolerance", "0.5", "--gpu-hour-price", "2.5"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replicas"] >= 1 and out["gpus"] == 8 * out["replicas"]
    assert out["simulated"]["slo_attainment"] >= 0.99
    assert out["estimate"]["tokens_per_s"] > 1000
    cost = out["cost"]
    assert cost["fleet_cost_per_hour"] == pytest.approx(out["gpus"] * 2.5)
    # The planned fleet has headroom for the SLO, so its tokens cost more than a replica run at the SLO's batch.
    assert cost["per_million_output_tokens_at_planned_load"] > cost["per_million_output_tokens_at_slo"] > 0
    assert cost["slo_batch"] > 1 and 0 < cost["batching_saving"] < 1
    assert 0 <= cost["prefix_caching_saving"] < 1


@pytest.mark.parametrize("argv, message", [
    (["sim", "--rate", "1", "--replicas", "2", "--gpu", "tpu9"], "unknown GPU"),
    (["sim", "--rate", "1", "--replicas", "2", "--disagg", "3:3"], "must be one of the --replicas"),
    (["sim", "--rate", "1", "--replicas", "2", "--disagg", "x"], "P:D"),
    (["sim", "--rate", "1", "--replicas", "2", "--policy", "nonsense"], "unknown routing policy"),
    (["sim", "--rate", "-1", "--replicas", "2"], "--rate"),
    (["sim", "--rate", "1", "--replicas", "0"], "--replicas"),
    (["plan", "--rate", "1", "--step-time", "/nonexistent.json"], "no such file"),
    (["plan", "--rate", "1", "--model", "llama-70b", "--gpu", "h100", "--gpus-per-replica", "1"], "does not fit"),
    (["sim", "--rate", "1", "--replicas", "2", "--duration", "10", "--warmup", "20"], "--warmup"),
])
def test_bad_inputs_are_one_line(argv, message, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own checks
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_sim_routes_by_class_targets_on_request(tmp_path, capsys):
    """The flag gives the simulator's requests their class targets; the JSON is the same shape."""
    from chatloom.cli import sim as sim_cli

    base = ["sim", "--step-time", small_step_time(tmp_path), *SMALL, "--rate", "4", "--replicas", "2",
            "--duration", "20"]
    parser = argparse.ArgumentParser()
    sim_cli.register(parser.add_subparsers())
    config = sim_cli.sim_config(parser.parse_args([*base, "--route-by-class-targets", "--slo-ttft-ms", "500"]))
    assert config.ttft_targets == {"interactive": 0.5, "reasoning": 10.0}
    assert sim_cli.sim_config(parser.parse_args(base)).ttft_targets == {}
    assert main([*base, "--route-by-class-targets"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["completed"] + run["refused"] + run["unfinished"] == run["requests"] > 0
