"""Two simulated days at 150 replicas' peak: the predictive controller against a reactive one and an oracle."""
from __future__ import annotations

import json

from chatloom.cli.main import main
from chatloom.sim.autoscale_day import met_share


def test_met_share_of_a_growing_and_a_draining_backlog():
    assert met_share(0.0, 60.0, 1.0, 60.0, 2.0) == (1.0, 0.0)  # arrivals equal capacity: no backlog
    ok, end = met_share(0.0, 120.0, 1.0, 60.0, 2.0)  # twice the capacity: the backlog passes 2 s after 2 s
    assert ok == 2.0 / 60.0 and end == 60.0
    ok, end = met_share(30.0, 0.0, 1.0, 60.0, 2.0)  # a backlog draining: late arrivals meet the target
    assert ok == 1 - 28.0 / 60.0 and end == 0.0


def test_sim_day_compares_the_controllers_on_the_same_trace(capsys, tmp_path):
    assert main(["sim-day", "--json", "--plot", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = {r["controller"]: r for r in out["runs"]}
    assert runs["oracle"]["replica_hours_vs_oracle"] == 1.0 and runs["oracle"]["peak_replicas"] >= 100
    # Forecasting beats reacting to the queue on both counts, on the same arrivals.
    assert runs["predictive"]["slo_attainment"] > runs["reactive"]["slo_attainment"]
    assert runs["predictive"]["replica_hours"] < runs["reactive"]["replica_hours"]
    assert (tmp_path / "autoscale_day.png").stat().st_size > 10_000


def test_bad_autoscale_settings_are_one_line(capsys):
    assert main(["sim-day", "--min-replicas", "20", "--max-replicas", "10"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "min (20) <= max (10)" in err[0]
