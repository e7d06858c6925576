"""`chatloom bench busy`: quiet and busy rounds alternate, and the busy neighbours are gone afterwards."""
from __future__ import annotations

import json

from chatloom.bench.busy import busy_neighbours
from chatloom.cli.main import main


def test_neighbours_spin_during_the_block_and_are_gone_after():
    with busy_neighbours(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)


def test_cli_reports_both_kinds_of_round(capsys):
    assert main(["bench", "busy", "--model", "tiny-random", "--rounds", "2", "--max-tokens", "3",
                 "--prompt-tokens", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["quiet_tpot_ms"]) == len(out["busy_tpot_ms"]) == 2
    assert out["quiet_tpot_p50_ms"] > 0 and out["busy_tpot_p50_ms"] > 0 and out["busy_over_quiet"] > 0
