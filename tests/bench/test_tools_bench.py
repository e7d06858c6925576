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
    held = result["configs"]["light"]["policies"]["hold"]
    assert held["holds"] == 2 and held["reprefilled_tokens"] == 0
    assert result["configs"]["light"]["policies"]["evict"]["evictions"] == 2
    assert "auto ok" in captured.err
