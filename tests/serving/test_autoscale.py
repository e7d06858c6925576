"""The predictive autoscaler: the forecast learns level, trend and season; the fleet is sized a start-up
time ahead, grows at once and shrinks only after the hold, a few replicas at a time."""
from __future__ import annotations

import math

import pytest

from chatloom.serving.autoscale import ArrivalForecast, AutoscaleConfig, PredictiveAutoscaler, ReactiveAutoscaler


def test_the_forecast_follows_a_trend_and_learns_the_season():
    f = ArrivalForecast(interval_s=60)  # a day's season: not learnt yet, level and trend only
    for i in range(40):
        f.observe(100 + 2 * i)
    assert f.forecast(0) == pytest.approx(180, abs=3)  # the next interval continues the trend
    assert f.forecast(4) > f.forecast(0)
    season = ArrivalForecast(interval_s=60, season_s=600)
    curve = [100 + 50 * math.sin(2 * math.pi * i / 10) for i in range(10)]
    for day in range(6):
        for v in curve:
            season.observe(v)
    # Six days in, each slot's forecast is that slot's value, not the day's mean.
    for h in range(10):
        assert season.forecast(h) == pytest.approx(curve[h], abs=6)


def test_it_scales_ahead_of_a_rise_and_down_slowly():
    config = AutoscaleConfig(min_replicas=2, max_replicas=100, capacity_rps=1.0, startup_s=180, interval_s=60,
                             headroom=1.0, scale_down_hold_s=120, scale_down_share=0.1)
    a = PredictiveAutoscaler(config)
    for i in range(30):  # 60 arrivals a minute, rising by 6 a minute: 1 request/s more every 10 minutes
        want = a.step(60 + 6 * i, now=60.0 * i)
    now_rps = (60 + 6 * 29) / 60
    assert want > math.ceil(now_rps)  # sized for the rate three minutes ahead, not the current one
    for i in range(30, 32):  # the load falls away: nothing changes during the hold
        assert a.step(0, now=60.0 * i) == want
    drained = [a.step(0, now=60.0 * i) for i in range(32, 40)]
    assert drained[0] < want and all(b - c <= max(1, b // 10) for b, c in zip([want] + drained, drained))
    assert drained[-1] >= config.min_replicas


def test_the_reactive_controller_adds_one_replica_per_interval_of_queueing():
    config = AutoscaleConfig(min_replicas=1, max_replicas=5, capacity_rps=1.0, startup_s=0, scale_down_hold_s=60)
    r = ReactiveAutoscaler(config, queue_wait_s=1.0)
    assert [r.step(5.0, 1.0, float(i)) for i in range(6)] == [2, 3, 4, 5, 5, 5]
    r.step(0.0, 0.1, 100.0)
    assert r.step(0.0, 0.1, 161.0) == 4


@pytest.mark.parametrize("fields", [{"min_replicas": 0}, {"min_replicas": 5, "max_replicas": 4},
                                    {"capacity_rps": 0}, {"headroom": 0.9}])
def test_bad_configs_are_refused(fields):
    base = dict(min_replicas=1, max_replicas=4, capacity_rps=1.0, startup_s=60)
    with pytest.raises(ValueError):
        AutoscaleConfig(**{**base, **fields})
