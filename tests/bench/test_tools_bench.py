"""`chatloom bench tools` in its quick mode: the JSON's shape (the figures themselves are for the docs)."""
from __future__ import annotations

import json

from chatloom.cli.main import main

FIGURES = {"resume_ttft_mean_s", "resume_ttft_p90_s", "bystander_ttft_p90_s", "bystander_tokens_per_s",
           "kv_occupancy_mean", "kv_occupancy_peak"}


def test_quick_tools_bench_reports_every_figure_per_policy(capsys, tmp_path):
    assert main(["bench", "tools", "--model", "tiny-random", "--quick", "--light-blocks", "256",
                 "--tight-blocks", "40", "--table"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert set(result["configs"]) == {"light", "tight"}
    for config in result["configs"].values():
        assert set(config["policies"]) == {"hold", "evict", "auto"}
        for figures in config["policies"].values():
            assert FIGURES <= set(figures) and figures["resume_ttft_mean_s"] > 0
        assert set(config["auto_vs_best"]) == FIGURES
        assert all(len(runs) == 1 for runs in config["per_round"].values())
        assert set(config["round_spread"]) == FIGURES
    held = result["configs"]["light"]["policies"]["hold"]
    assert held["holds"] == 2 and held["reprefilled_tokens"] == 0
    assert result["configs"]["light"]["policies"]["evict"]["evictions"] == 2
    assert "auto ok" in captured.err


def test_figures_pool_every_run_s_samples():
    from chatloom.bench.tools import figures

    def run(resumes: list[float], tokens: int, seconds: float) -> dict:
        return {"resume_ttft": resumes, "bystander_ttft": [0.1], "bystander_tokens": tokens, "seconds": seconds,
                "kv_samples": [0.5], "counters": {"holds": 1, "evictions": 0}}

    out = figures([run([1.0] * 9 + [5.0], 10, 2.0), run([1.0] * 10, 30, 2.0)])
    # The p90 of the 20 resumes pooled (a mean of the two runs' p90s would say 3.0); tokens over all seconds.
    assert out["resume_ttft_p90_s"] == 1.0 and out["resume_ttft_mean_s"] == 1.2
    assert out["bystander_tokens_per_s"] == 10.0 and out["holds"] == 2 and out["seconds"] == 4.0


def test_the_spread_between_rounds_is_the_widest_policy_s():
    from chatloom.bench.tools import FIGURES, spread

    rounds = {"hold": [dict.fromkeys(FIGURES, 1.0), dict.fromkeys(FIGURES, 1.0)],
              "evict": [dict.fromkeys(FIGURES, 1.0), dict.fromkeys(FIGURES, 3.0)]}
    assert spread(rounds)["resume_ttft_p90_s"] == 1.0  # (3 - 1) / 2
    assert spread({"hold": [dict.fromkeys(FIGURES, 1.0)]})["resume_ttft_p90_s"] is None
