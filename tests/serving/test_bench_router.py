"""`chatloom bench router` end to end on running tiny replicas (speed is measured by running it, not here)."""
from __future__ import annotations

from chatloom.bench.router_policies import conversations, plot, run_router_bench, table
from chatloom.cli.main import main


def test_bench_router_reports_every_policy_and_plots(fleet, tmp_path):
    urls = [fleet[0].url, fleet[1].url]
    result = run_router_bench("tiny-random", urls, ["round_robin", "prefix_aware"], users=2, turns=3, max_tokens=3,
                              system_words=20, user_words=10)
    assert set(result["policies"]) == {"round_robin", "prefix_aware"}
    for r in result["policies"].values():
        assert r["requests"] == 6 and len(r["ttft_mean_by_turn_s"]) == 3
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] and r["throughput_tok_s"] > 0
        assert 0 < r["prefix_hit_rate"] < 1
    # The same conversations (greedy) for every policy: the same prompt tokens.
    assert result["policies"]["round_robin"]["prompt_tokens"] == result["policies"]["prefix_aware"]["prompt_tokens"]
    assert "prefix_aware" in result["vs_round_robin"]
    assert "TTFT p90" in table(result)
    plot(result, str(tmp_path / "ttft.png"))
    assert (tmp_path / "ttft.png").read_bytes()[:4] == b"\x89PNG"


def test_workload_is_seeded():
    assert conversations(3, 2, 7, 10, 5) == conversations(3, 2, 7, 10, 5) != conversations(3, 2, 8, 10, 5)


def test_bad_policy_is_one_line_before_any_replica_starts(capsys):
    assert main(["bench", "router", "--policies", "fastest"]) == 2
    assert "unknown fastest" in capsys.readouterr().err
