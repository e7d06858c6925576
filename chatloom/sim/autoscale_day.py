"""Two simulated days of a fleet under autoscaling: a predictive controller, a reactive one and an oracle.

The load is a daily curve (peak three times the trough) with Poisson arrivals per interval, and on the
second day a sudden burst no season foresees. The first day is warm-up (the forecaster learns the
season); figures are of the second. Each controller is the real one from serving/autoscale.py.

The fleet is a fluid model at the interval's grain: ready replicas serve `capacity_rps` each (what a
replica serves within its SLO, from the step-time model), a backlog builds when arrivals exceed that,
and a request meets its SLO when the backlog ahead of it clears within the TTFT target. A replica
asked for is ready a start-up time later and costs from the moment it is asked for. The oracle knows
the arrivals ahead and has exactly the replicas each interval's arrivals need, with no headroom,
each started in time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from chatloom.serving.autoscale import AutoscaleConfig, PredictiveAutoscaler, ReactiveAutoscaler

DAY = 86400.0


@dataclass(frozen=True)
class DayLoad:
    peak_rps: float
    trough_share: float = 1 / 3       # the peak is three times the trough
    peak_hour: float = 15.0
    burst_hour: float = 10.0          # on the second day only
    burst_minutes: float = 30.0
    burst_factor: float = 1.6
    days: int = 2

    def rates(self, interval_s: float) -> np.ndarray:
        """Expected arrivals per second in each interval."""
        t = np.arange(0, self.days * DAY, interval_s) + interval_s / 2
        phase = 2 * math.pi * (t / 3600 - self.peak_hour) / 24
        shape = self.trough_share + (1 - self.trough_share) * (0.5 + 0.5 * np.cos(phase))
        rates = self.peak_rps * shape
        start = (self.days - 1) * DAY + self.burst_hour * 3600
        rates[(t >= start) & (t < start + self.burst_minutes * 60)] *= self.burst_factor
        return rates


def met_share(backlog0: float, arrivals: float, capacity: float, interval_s: float, ttft_s: float) -> tuple[float, float]:
    """(share of the interval's arrivals that meet the TTFT target, backlog at its end) for a backlog that
    changes linearly; a request meets the target when the backlog ahead of it clears in ttft_s."""
    if capacity <= 0:
        return 0.0, backlog0 + arrivals
    slope = arrivals / interval_s - capacity  # backlog change per second
    limit = capacity * ttft_s
    end = max(0.0, backlog0 + slope * interval_s)
    if slope == 0:
        ok = 1.0 if backlog0 <= limit else 0.0
    elif slope > 0:
        ok = min(1.0, max(0.0, (limit - backlog0) / slope / interval_s))
    else:
        ok = 1.0 - min(1.0, max(0.0, (backlog0 - limit) / -slope / interval_s))
    return ok, end


def run_day(controller: str, load: DayLoad, config: AutoscaleConfig, ttft_s: float, seed: int = 0) -> dict:
    dt = config.interval_s
    rates = load.rates(dt)
    arrivals = np.random.default_rng(seed).poisson(rates * dt).astype(float)
    lead = math.ceil(config.startup_s / dt)
    measured_from = int((load.days - 1) * DAY / dt)
    oracle = replace(config, headroom=1.0)
    predictive = PredictiveAutoscaler(config)
    reactive = ReactiveAutoscaler(config)
    ready, starting = config.min_replicas, []  # starting: the interval index each becomes ready
    backlog, met, total, replica_seconds, peak = 0.0, 0.0, 0.0, 0.0, 0
    trace = []
    for i, a in enumerate(arrivals):
        now = i * dt
        ready += sum(1 for r in starting if r <= i)
        starting = [r for r in starting if r > i]
        if controller == "oracle":  # exactly what this interval's arrivals need, no headroom, started in time
            ready, starting = oracle.replicas_for(a / dt), []
            nxt = oracle.replicas_for(max(arrivals[i:i + lead + 1]) / dt)
            cost = max(ready, nxt)
        capacity = ready * config.capacity_rps
        ok, backlog = met_share(backlog, a, capacity, dt, ttft_s)
        if i >= measured_from:
            met += ok * a
            total += a
            replica_seconds += (cost if controller == "oracle" else ready + len(starting)) * dt
            peak = max(peak, ready)
        if controller != "oracle":
            if controller == "predictive":
                want = predictive.step(a, now + dt)
            else:
                want = reactive.step(backlog / capacity if capacity else float("inf"),
                                     a / dt / capacity if capacity else 1.0, now + dt)
            have = ready + len(starting)
            if want > have:
                starting += [i + 1 + lead] * (want - have)
            elif want < have:  # cancel starts first, then drain ready replicas
                drop = have - want
                cancel = min(drop, len(starting))
                starting = starting[:len(starting) - cancel]
                ready -= drop - cancel
        trace.append((now / 3600, rates[i], capacity))
    return {"controller": controller, "slo_attainment": round(met / total, 5) if total else None,
            "replica_hours": round(replica_seconds / 3600, 1), "peak_replicas": peak, "trace": trace}


def compare(load: DayLoad, config: AutoscaleConfig, ttft_s: float, seed: int = 0) -> dict:
    runs = {name: run_day(name, load, config, ttft_s, seed) for name in ("oracle", "predictive", "reactive")}
    oracle_hours = runs["oracle"]["replica_hours"]
    for r in runs.values():
        r["replica_hours_vs_oracle"] = round(r["replica_hours"] / oracle_hours, 3) if oracle_hours else None
    return runs
