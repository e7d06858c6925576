"""`chatloom bench streams`: the report's shape and every stream of a quick run complete; the
starvation and percentile arithmetic."""
from __future__ import annotations

import json

from chatloom.bench.streams import percentiles_ms, starved_streams, summarize
from chatloom.cli.main import main


def test_quick_run_completes_every_stream_through_the_gateway(capsys):
    assert main(["bench", "streams", "--quick", "--table"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["config"]["streams"] == 20 and out["config"]["tokens_per_stream"] == 10
    for name in ("direct", "gateway"):
        r = out[name]
        assert r["completed"] == r["streams"] == 20 and r["errors"] == 0, r["error_examples"]
        assert r["tokens_received"] == 200
        assert set(r["gap_ms"]) == {"p50", "p90", "p99", "max"} and r["gap_ms"]["p50"] > 0
        assert isinstance(r["starved_streams"], int)
    assert out["gateway"]["cpu_s"] > 0 and out["gateway"]["cpu_us_per_token"] > 0
    assert out["gateway"]["metered_requests"] == 20  # every answer in the usage rows
    assert isinstance(out["target"]["met"], bool)
    assert "gateway" in captured.err and "direct" in captured.err


def test_a_silent_stream_is_starved_only_while_others_receive():
    s = 1_000_000_000
    # Stream 0 is silent from 1 s to 3 s while stream 1 receives at 2 s: starved.
    assert starved_streams([[0, s, 3 * s], [0, s, 2 * s, 3 * s]], s) == 1
    # Both silent over the same stretch (the replica paused): nobody is starved.
    assert starved_streams([[0, 3 * s], [0, 3 * s]], s) == 0
    assert starved_streams([[0, s // 2, s], [0, s]], s) == 0


def test_summary_counts_incomplete_streams_and_errors():
    raw = {"started_ns": 0, "ended_ns": 2_000_000_000, "loop_lag_ns": [1_000_000],
           "streams": [{"seqs": [0, 1], "gaps_ns": [2_000_000, 4_000_000], "arrivals_ns": [1, 2], "error": None},
                       {"seqs": [0], "gaps_ns": [3_000_000], "arrivals_ns": [1], "error": None},
                       {"seqs": [], "gaps_ns": [], "arrivals_ns": [], "error": "HTTP 429: busy"}]}
    out = summarize(raw, tokens=2)
    assert (out["completed"], out["errors"], out["tokens_received"]) == (1, 1, 3)
    assert out["gap_ms"] == {"p50": 3.0, "p90": 4.0, "p99": 4.0, "max": 4.0}
    assert percentiles_ms([]) == {"p50": None, "p90": None, "p99": None, "max": None}
