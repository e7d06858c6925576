"""Two simulated days of a fleet under autoscaling and the degrade ladder, per traffic class.

The load is a daily curve (peak three times the trough) with Poisson arrivals per class, and on the
second day a sudden burst no season foresees. The first day is warm-up (the forecaster learns the
season); figures are of the second. The controllers are the real ones (serving/autoscale.py) and so
is the ladder (serving/degrade.py), run on the simulated clock.

The fleet is a fluid model at a one-second grain, in work: each request brings the replica-seconds
its class takes at the ladder's level when it arrives (sim/day_classes.py, from the step-time model),
ready replicas do one replica-second of work a second, and the work waiting is served in admission
order (pro, plus, reasoning, free, batch last). A request's wait is the work ahead of it at its
priority or above over the capacity higher classes leave it; it meets its class's TTFT target when
that wait plus its own prefill fits. The ladder reads the admission queue's wait (the work waiting
ahead of the lowest interactive class, over the capacity) and the KV occupancy (the busy share of the
capacity times the KV share the TPOT target's batch fills). A replica asked for is ready a start-up
time later and costs from the moment it is asked for. The oracle knows the work each interval brings
and has exactly the replicas it needs, with no headroom, each started in time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from chatloom.serving.autoscale import AutoscaleConfig, PredictiveAutoscaler, ReactiveAutoscaler
from chatloom.serving.degrade import STEPS, DegradeLadder, Signals
from chatloom.settings.tree import DegradeSettings
from chatloom.sim.day_classes import ClassWork

DAY = 86400.0
CONTROLLERS = ("oracle", "predictive", "reactive")


@dataclass(frozen=True)
class DayLoad:
    peak_rps: float
    trough_share: float = 1 / 3       # the peak is three times the trough
    peak_hour: float = 15.0
    burst_hour: float = 10.0          # on the second day only
    burst_minutes: float = 30.0
    burst_factor: float = 1.6
    days: int = 2

    def rates(self, step_s: float) -> np.ndarray:
        """Expected arrivals per second in each step of `step_s` seconds."""
        t = np.arange(0, self.days * DAY, step_s) + step_s / 2
        phase = 2 * math.pi * (t / 3600 - self.peak_hour) / 24
        shape = self.trough_share + (1 - self.trough_share) * (0.5 + 0.5 * np.cos(phase))
        rates = self.peak_rps * shape
        start = (self.days - 1) * DAY + self.burst_hour * 3600
        rates[(t >= start) & (t < start + self.burst_minutes * 60)] *= self.burst_factor
        return rates


@dataclass(frozen=True)
class DayModel:
    classes: list[ClassWork]
    degrade: DegradeSettings | None   # None: no ladder
    queue_max_wait_s: float
    kv_full: float                    # KV share a replica holds when busy all the time
    step_s: float = 1.0

    @property
    def capacity_rps(self) -> float:
        """Requests one replica serves a second, undegraded, at the class mix."""
        return 1.0 / sum(c.share * c.work[0] for c in self.classes)


def ladder_on(model: DayModel) -> bool:
    return model.degrade is not None and model.degrade.enabled


def draw_arrivals(load: DayLoad, model: DayModel, seed: int) -> np.ndarray:
    """Requests arriving per step and class (steps x classes), the same for every controller."""
    shares = np.array([c.share for c in model.classes])
    lam = load.rates(model.step_s)[:, None] * shares[None, :] * model.step_s
    return np.random.default_rng(seed).poisson(lam)


def run_day(controller: str, load: DayLoad, config: AutoscaleConfig, model: DayModel, arrivals: np.ndarray) -> dict:
    h = model.step_s
    per = max(1, round(config.interval_s / h))  # steps per controller interval
    dt = per * h
    classes = model.classes
    k = len(classes)
    work = np.array([c.work for c in classes])          # class x level
    prefill = np.array([c.prefill_s for c in classes])
    ttft = np.array([c.ttft_s for c in classes])
    interactive_ttft = min(c.ttft_s for c in classes if c.name.startswith("interactive"))
    batch = np.array([c.name == "batch" for c in classes])
    affected = np.array([c.affected for c in classes])  # class x step
    lead = math.ceil(config.startup_s / dt)
    measured_from = int(round((load.days - 1) * DAY / h))
    # The oracle's replicas per interval: the undegraded work the interval brings, done within it.
    interval_work = (arrivals @ work[:, 0]).reshape(-1, per).sum(axis=1) if len(arrivals) % per == 0 else \
        np.add.reduceat(arrivals @ work[:, 0], np.arange(0, len(arrivals), per))
    oracle_need = [min(config.max_replicas, max(config.min_replicas, math.ceil(w / dt - 1e-9))) for w in interval_work]
    predictive = PredictiveAutoscaler(config)
    # The reactive controller adds replicas once the queue wait reaches the ladder's first step (a
    # higher threshold never fires: the ladder keeps the wait below it by degrading instead).
    first_wait = model.queue_max_wait_s * model.degrade.effort_queue_wait_share if ladder_on(model) else 1.0
    reactive = ReactiveAutoscaler(config, queue_wait_s=first_wait)

    clock = [0.0]
    signal = [Signals(0.0, 0.0)]
    ladder = DegradeLadder(model.degrade, model.queue_max_wait_s, lambda: signal[0], lambda: clock[0]) \
        if ladder_on(model) else None

    ready, starting = config.min_replicas, []  # starting: the interval index each becomes ready
    backlog = np.zeros(k)
    met, total = np.zeros(k), np.zeros(k)
    degraded = np.zeros(len(STEPS))
    deferred = 0.0
    level_seconds = np.zeros(len(STEPS) + 1)
    replica_seconds, peak = 0.0, 0
    interval_arrivals, interval_served = 0.0, 0.0
    trace = []
    for j in range(len(arrivals)):
        i, sub = divmod(j, per)
        now = j * h
        measuring = j >= measured_from
        if sub == 0:
            if i > 0 and controller != "oracle":
                capacity = ready * dt
                if controller == "predictive":
                    want = predictive.step(interval_arrivals, now)
                else:
                    want = reactive.step(signal[0].queue_wait_s, interval_served / capacity if capacity else 1.0, now)
                have = ready + len(starting)
                if want > have:
                    starting += [i + lead] * (want - have)
                elif want < have:  # cancel starts first, then drain ready replicas
                    drop = have - want
                    cancel = min(drop, len(starting))
                    starting = starting[:len(starting) - cancel]
                    ready -= drop - cancel
            ready += sum(1 for r in starting if r <= i)
            starting = [r for r in starting if r > i]
            if controller == "oracle":
                ready, starting = oracle_need[i], []
                paid = max(oracle_need[i:i + lead + 1])  # replicas starting for the coming intervals
            else:
                paid = ready + len(starting)
            if i >= measured_from // per:
                replica_seconds += paid * dt
                peak = max(peak, ready)
            interval_arrivals = interval_served = 0.0
            trace.append((now / 3600, float(arrivals[j:j + per].sum()) / dt, ready * model.capacity_rps,
                          ladder.level if ladder else 0))
        clock[0] = now
        level = ladder.update() if ladder else 0
        n = arrivals[j]
        work_in = n * work[:, level]
        rate = float(ready)  # replica-seconds of work a second
        ahead, higher = 0.0, 0.0
        if measuring:
            # A request waits for the work queued at its priority or above, done at the capacity the
            # classes above leave while they keep arriving; its own class's arrivals of this step
            # are spread evenly ahead of it.
            for c in range(k):
                ahead += backlog[c]
                left = max(rate - higher, 0.0)
                if n[c]:
                    room = (ttft[c] - prefill[c, level]) * left
                    met[c] += n[c] * min(1.0, max(0.0, (room - ahead) / work_in[c]))
                    if batch[c]:
                        room = (interactive_ttft - prefill[c, level]) * left
                        deferred += n[c] * (1 - min(1.0, max(0.0, (room - ahead) / work_in[c])))
                    total[c] += n[c]
                higher += work_in[c] / h
            if level:
                degraded[:level] += n @ affected[:, :level]
            level_seconds[level] += h
        backlog += work_in
        budget = rate * h
        for c in range(k):
            served = min(backlog[c], budget)
            backlog[c] -= served
            budget -= served
        busy = rate * h - budget
        interval_arrivals += float(n.sum())
        interval_served += busy
        waiting = float(backlog[~batch].sum())
        signal[0] = Signals(waiting / rate if rate else float("inf"),
                            model.kv_full * (busy / (rate * h) if rate else 1.0))
    names = [c.name for c in classes]
    by_class = {names[c]: {"requests": int(total[c]), "ttft_target_s": float(ttft[c]),
                           "slo_attainment": round(float(met[c] / total[c]), 5) if total[c] else None}
                for c in range(k)}
    all_total = float(total.sum())
    return {"controller": controller,
            "slo_attainment": round(float(met.sum() / all_total), 5) if all_total else None,
            "worst_class_attainment": min((v["slo_attainment"] for v in by_class.values()
                                           if v["slo_attainment"] is not None), default=None),
            "by_class": by_class,
            "degraded_requests": {s: int(round(degraded[i])) for i, s in enumerate(STEPS)} |
                                 {"batch_deferred": int(round(deferred))},
            "ladder_minutes_at_level": {str(lv): round(float(level_seconds[lv]) / 60, 1)
                                        for lv in range(len(STEPS) + 1)},
            "replica_hours": round(replica_seconds / 3600, 1), "peak_replicas": peak, "trace": trace}


def compare(load: DayLoad, config: AutoscaleConfig, model: DayModel, seed: int = 0) -> dict:
    """The three controllers on the same arrivals; replica-hours also as a multiple of the oracle's."""
    config = replace(config, capacity_rps=model.capacity_rps)
    arrivals = draw_arrivals(load, model, seed)
    runs = {}
    for name in CONTROLLERS:
        cfg = replace(config, headroom=1.0) if name == "oracle" else config
        runs[name] = run_day(name, load, cfg, model, arrivals)
    oracle_hours = runs["oracle"]["replica_hours"]
    for r in runs.values():
        r["replica_hours_vs_oracle"] = round(r["replica_hours"] / oracle_hours, 3) if oracle_hours else None
    return runs


def sim_settings(ttft_s: float = 2.0, tpot_s: float = 0.05, reasoning_ttft_s: float = 10.0,
                 batch_ttft_s: float = 900.0, small_model: str | None = "llama-3.1-8b"):
    """The settings a simulated day runs with: the per-class targets and a ladder whose wait thresholds
    (0.3, 0.6 and 1.2 s of a 30 s queue limit) come before the interactive 2 s target is missed."""
    from chatloom.settings.tree import SloTarget, TrafficSettings

    traffic = TrafficSettings(slo_ttft_s=ttft_s, slo_tpot_s=tpot_s, slo_classes={
        "reasoning": SloTarget(ttft_s=reasoning_ttft_s, tpot_s=0.2), "batch": SloTarget(ttft_s=batch_ttft_s)})
    degrade = DegradeSettings(effort_queue_wait_share=0.01, small_model_queue_wait_share=0.02,
                              max_tokens_queue_wait_share=0.04, small_model=small_model, hold_s=60.0)
    return traffic, degrade


def build_model(traffic, degrade: DegradeSettings | None, model: str = "llama-70b", gpu: str = "h100",
                gpus: int = 8, small_gpus: int = 1, step_s: float = 1.0) -> DayModel:
    """The classes' work on `model` (and the ladder's small model) from their roofline step-time models."""
    from chatloom.sim.cost import batch_within
    from chatloom.sim.day_classes import DEFAULT_CLASSES, day_classes, lognormal_mean_below, tpot_target
    from chatloom.sim.hardware import roofline_replica

    big = roofline_replica(model, gpu, gpus)
    small = roofline_replica(degrade.small_model, gpu, small_gpus) if degrade and degrade.small_model else None
    classes = day_classes(traffic, degrade or DegradeSettings(enabled=False), big, small)
    # The KV a busy replica holds: the TPOT target's batch at the mix's mean context.
    ctx = sum(c.share * (c.prompt_tokens + lognormal_mean_below(c.answer_median, c.answer_sigma) / 2)
              for c in DEFAULT_CLASSES)
    batch = batch_within(big, ctx, tpot_target(traffic, DEFAULT_CLASSES))
    return DayModel(classes, degrade, traffic.queue_max_wait_s, min(1.0, batch * ctx / big.pool_tokens), step_s)
