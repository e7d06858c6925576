"""Two simulated days at 150 replicas' peak, per traffic class: the predictive controller and the degrade
ladder against a reactive controller and an oracle, on the same arrivals."""
from __future__ import annotations

import json

import numpy as np
import pytest

from chatloom.cli.main import main
from chatloom.serving.autoscale import AutoscaleConfig
from chatloom.sim.autoscale_day import DayLoad, build_model, draw_arrivals, run_day, sim_settings
from chatloom.sim.day_classes import THINKING_TOKENS, lognormal_mean_below, share_above


@pytest.fixture(scope="module")
def day(tmp_path_factory):
    out = tmp_path_factory.mktemp("day")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["sim-day", "--json", "--step-s", "2", "--plot", str(out)]) == 0
    return json.loads(buf.getvalue()), out


def test_predictive_scaling_with_the_ladder_meets_every_class_within_1_2x_the_oracle(day):
    out, _ = day
    runs = {r["controller"]: r for r in out["runs"]}
    assert runs["oracle"]["replica_hours_vs_oracle"] == 1.0 and runs["oracle"]["peak_replicas"] >= 100
    p, r = runs["predictive"], runs["reactive"]
    assert set(p["by_class"]) == {"interactive:pro", "interactive:plus", "interactive:free", "reasoning", "batch"}
    assert all(c["slo_attainment"] >= 0.99 for c in p["by_class"].values()), p["by_class"]
    assert p["replica_hours_vs_oracle"] <= 1.2
    # The reactive controller on the same trace: its worst class misses, at more replica-hours.
    assert r["worst_class_attainment"] < 0.99 and r["replica_hours"] > p["replica_hours"]
    # The burst is absorbed by the ladder: effort capped and free requests on the small model.
    assert p["degraded_requests"]["effort"] > 0 and p["degraded_requests"]["small_model"] > 0
    assert 0 < sum(v for k, v in p["ladder_minutes_at_level"].items() if k != "0") < 60


def test_the_plot_shows_capacity_and_the_ladder(day):
    _, path = day
    assert (path / "autoscale_day.png").stat().st_size > 10_000


def test_without_the_ladder_the_burst_is_missed():
    traffic, degrade = sim_settings()
    model = build_model(traffic, None, step_s=2.0)
    load = DayLoad(peak_rps=150 * model.capacity_rps)
    config = AutoscaleConfig(10, 10_000, model.capacity_rps, 300.0, 60.0, 1.1, 300.0)
    run = run_day("predictive", load, config, model, draw_arrivals(load, model, 0))
    assert run["worst_class_attainment"] < 0.99
    assert run["degraded_requests"]["small_model"] == 0


def test_each_step_makes_its_classes_cheaper():
    traffic, degrade = sim_settings()
    model = build_model(traffic, degrade)
    by = {c.name: c for c in model.classes}
    reasoning, free, pro = by["reasoning"], by["interactive:free"], by["interactive:pro"]
    assert reasoning.work[1] < reasoning.work[0] and reasoning.affected[0] == 1.0  # effort medium -> low
    assert free.work[2] < free.work[1] / 3 and free.affected[1] == 1.0  # 8B on one GPU against 70B on eight
    assert free.work[3] < free.work[2] and 0 < free.affected[2] < 1  # answers cut at the cap
    assert len(set(pro.work)) == 1 and pro.affected == (0.0, 0.0, 0.0)  # the pro tier is never degraded
    assert by["batch"].ttft_s == 900.0 and reasoning.ttft_s == 10.0 and pro.ttft_s == 2.0


def test_a_capped_lognormal_mean_matches_a_sample():
    rng = np.random.default_rng(1)
    x = np.exp(np.log(360.0) + 0.8 * rng.standard_normal(400_000))
    assert lognormal_mean_below(360.0, 0.8, 256) == pytest.approx(np.minimum(x, 256).mean(), rel=0.01)
    assert lognormal_mean_below(360.0, 0.8) == pytest.approx(x.mean(), rel=0.01)
    assert share_above(360.0, 0.8, 256) == pytest.approx((x > 256).mean(), abs=0.005)


def test_the_thinking_budgets_are_the_apps():
    from chatloom.app.traffic.reasoning import BUDGET_TOKENS, EFFORTS

    assert THINKING_TOKENS == BUDGET_TOKENS and tuple(THINKING_TOKENS) == EFFORTS


def test_the_app_runs_the_serving_rooms_ladder():
    from chatloom.app.traffic import degrade as app_degrade
    from chatloom.serving import degrade

    assert app_degrade.DegradeLadder is degrade.DegradeLadder and app_degrade.STEPS == degrade.STEPS


def test_bad_autoscale_settings_are_one_line(capsys):
    assert main(["sim-day", "--min-replicas", "20", "--max-replicas", "10"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "min (20) <= max (10)" in err[0]
