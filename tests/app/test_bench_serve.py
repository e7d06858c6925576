"""`chatloom bench serve` against a live server on loopback (the tiny model)."""
from __future__ import annotations

import json

import pytest

from chatloom.bench.serve import Result, parse_goodput, percentiles
from chatloom.cli import main as cli_main


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
