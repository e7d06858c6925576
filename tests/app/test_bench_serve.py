"""`chatloom bench serve` against a live server on loopback (the tiny model)."""
from __future__ import annotations

import json

import pytest

from chatloom.bench.serve import Result, parse_goodput, percentiles
from chatloom.cli.main import main as cli_main


def test_bench_serve_against_a_live_server(live, http, admin, capsys):
    r = http.post("/auth/signup", json={"username": "bencher", "password": "correct horse"})
    token = r.json()["token"]
    # The free tier runs two answers at once per user; a load test needs more.
    assert http.put("/admin/users/bencher/tier", json={"tier": "pro"}, headers=admin).status_code == 200
    key = http.post("/auth/api-keys", headers={"Authorization": f"Bearer {token}"}).json()["key"]
    code = cli_main(["bench", "serve", "--base-url", live.url, "--model", "tiny-random", "--num-prompts", "6",
                     "--max-concurrency", "3", "--max-tokens", "8", "--api-key", key,
                     "--goodput", "ttft:60000", "tpot:60000"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["completed"] == 6 and result["failed"] == 0 and result["errors_by_status"] == {}
    assert result["total_output_tokens"] == 6 * 8  # greedy on random weights never stops early
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(result[metric]) == {"mean", "p50", "p90", "p99"}
        assert 0 < result[metric]["p50"] <= result[metric]["p99"]
    assert result["ttft_ms"]["p99"] <= result["e2el_ms"]["p99"]
    assert result["output_throughput"] > 0 and result["goodput"] == result["request_throughput"]

    # Poisson arrivals; a wrong key shows up as errors by status, not a crash.
    code = cli_main(["bench", "serve", "--base-url", live.url, "--model", "tiny-random", "--num-prompts", "3",
                     "--request-rate", "50", "--max-tokens", "4", "--api-key", "cl-wrong"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["completed"] == 0 and result["errors_by_status"] == {"401": 3}


def test_metric_definitions():
    r = Result(ok=True, ttft=0.1, latency=1.0, output_tokens=10)
    assert r.tpot == pytest.approx(0.1)  # (latency - ttft) / (tokens - 1)
    assert Result(ok=True, ttft=0.1, latency=0.1, output_tokens=1).tpot is None
    assert percentiles([0.001, 0.002, 0.003])["p50"] == 2.0
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    with pytest.raises(ValueError):
        parse_goodput(["speed:5"])


def test_bench_serve_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:  # neither --request-rate nor --max-concurrency
        cli_main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m"])
    assert exit_info.value.code == 2
    assert cli_main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--request-rate", "1",
                     "--goodput", "nope"]) == 2
    assert "error" in capsys.readouterr().err


def test_bench_paired_alternates_two_servers(live, http, admin, capsys):
    """The same server as candidate and baseline (two accounts): every round asks both the same
    question, in ABBA order, and the figures come with their interval."""
    keys = []
    for name in ("pair-a", "pair-b"):
        token = http.post("/auth/signup", json={"username": name, "password": "correct horse"}).json()["token"]
        keys.append(http.post("/auth/api-keys", headers={"Authorization": f"Bearer {token}"}).json()["key"])
    code = cli_main(["bench", "paired", "--url", live.url, "--api-key", keys[0], "--baseline-url", live.url,
                     "--baseline-api-key", keys[1], "--rounds", "4", "--warmup", "1", "--min-tokens", "3",
                     "--max-tokens", "6", "--target-tpot-ratio", "100", "--table"])
    assert code == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["models"] == {"chatloom": "tiny-random", "baseline": "tiny-random"}  # from /v1/models
    assert result["rounds"] == result["rounds_compared"] == 4
    assert [r["candidate_first"] for r in result["per_round"]] == [False, True, False, True]  # after 1 warm-up
    budgets = [r["max_tokens"] for r in result["per_round"]]
    assert all(3 <= b <= 6 for b in budgets)
    for side in ("candidate", "baseline"):
        assert result[side]["completed"] == 4 and result[side]["failed"] == 0
        assert result[side]["output_tokens"] == sum(budgets)  # random weights never stop early
    assert result["same_output_tokens_rounds"] == 4
    tpot = result["tpot_ratio"]
    assert tpot["p50_ratio_ci95"][0] <= tpot["p50_ratio"] <= tpot["p50_ratio_ci95"][1]
    assert tpot["meets_target"] and tpot["rounds_within_target"] == 4
    assert "TPOT chatloom/baseline" in captured.err


def test_paired_summary_from_known_rounds():
    from chatloom.bench.paired import Round, summarize

    def res(ttft, tpot, tokens=11):
        return Result(ok=True, ttft=ttft, latency=ttft + tpot * (tokens - 1), output_tokens=tokens)

    rounds = [Round("q", 11, i % 2 == 0, res(0.02, 0.005 * (1 + i / 10)), res(0.04, 0.010 * (1 + i / 10)))
              for i in range(6)]
    rounds.append(Round("q", 11, True, res(0.02, 0.005), Result(status="500", error="boom")))  # not compared
    s = summarize(rounds, "new", "old", target_tpot_ratio=0.8, target_ttft_ratio=0.4)
    assert s["rounds"] == 7 and s["rounds_compared"] == 6
    assert s["baseline"]["failed"] == 1 and "500: boom" in s["baseline"]["sample_errors"][0]
    t = s["tpot_ratio"]
    assert t["p50_ratio"] == pytest.approx(0.5) and t["p50_ratio_ci95"] == [pytest.approx(0.5)] * 2
    assert t["meets_target"] and t["meets_target_at_ci95"] and t["rounds_within_target"] == 6
    f = s["ttft_ratio"]
    assert f["p50_ratio"] == pytest.approx(0.5) and not f["meets_target"] and f["rounds_within_target"] == 0
    # Too few rounds where both answered: no ratios, and it says so.
    few = summarize(rounds[-1:], "new", "old")
    assert "tpot_ratio" not in few and "fewer than two" in few["note"]


def test_bench_paired_bad_arguments(capsys):
    assert cli_main(["bench", "paired", "--url", "http://127.0.0.1:9", "--baseline-url", "http://127.0.0.1:9",
                     "--rounds", "1"]) == 2
    assert "--rounds must be at least 2" in capsys.readouterr().err
    assert cli_main(["bench", "paired", "--url", "http://127.0.0.1:9", "--baseline-url", "http://127.0.0.1:9",
                     "--min-tokens", "9", "--max-tokens", "3"]) == 2
    assert "--min-tokens" in capsys.readouterr().err
    # Nothing listening: one line naming the server, no traceback.
    assert cli_main(["bench", "paired", "--url", "http://127.0.0.1:9", "--baseline-url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "chatloom: cannot reach http://127.0.0.1:9/v1/models" in err and "Traceback" not in err
