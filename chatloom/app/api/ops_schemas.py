"""GET /admin/ops: one snapshot of the service's load for the browser app's Operations page.

Everything here is read from what the gateway already keeps (the backend's stats, the admission
queue, the metrics registry, the degrade ladder, the autoscaler) plus one query for today's usage per
tier, so polling it every two seconds costs little. Counts are totals since the gateway started; the
page turns them into rates from one snapshot to the next.
"""
from __future__ import annotations

import time
from typing import Literal

from prometheus_client import Counter
from pydantic import BaseModel, Field

from chatloom.app.api.deps import AppContext
from chatloom.app.traffic.degrade import STEPS
from chatloom.serving import BackendStats
from chatloom.serving.backend import ReplicaStatus


class OpsReplica(BaseModel):
    url: str
    state: Literal["ready", "draining", "ejected"] = Field(
        description="ready: takes new requests; draining: finishing its answers before it stops; "
                    "ejected: failed its health checks, sent nothing until it recovers")
    inflight: int = Field(description="Requests the router has running on it now.")
    served: int = Field(description="Requests it has served since the gateway started.")
    kv_cache_usage: float | None = Field(description="Its KV-cache occupancy, 0 to 1, from its last /metrics "
                                                     "(null where unknown).")
    error: str | None = Field(None, description="Why it was ejected, where it was.")

    @classmethod
    def of(cls, r: ReplicaStatus) -> "OpsReplica":
        state = "draining" if r.draining else "ready" if r.healthy else "ejected"
        kv = r.load.kv_cache_usage_perc if r.load is not None else None
        return cls(url=r.url, state=state, inflight=r.inflight, served=r.served, kv_cache_usage=kv, error=r.error)


class OpsQueue(BaseModel):
    waiting: int = Field(description="Requests in the admission queue now.")
    running: int = Field(description="Requests admitted and not yet finished.")
    max_running: int
    oldest_wait_s: float = Field(description="How long the oldest request waiting now has waited.")
    recent_wait_s: float = Field(description="The longest wait of a request admitted or refused in the last "
                                             "few seconds (the degrade ladder's queue signal).")
    max_wait_s: float = Field(description="traffic.queue_max_wait_s: a longer wait is refused with 503.")
    timeouts: int = Field(description="Requests refused with 503 by the queue since start.")


class OpsClass(BaseModel):
    name: str = Field(description="The traffic class: 'interactive:<tier>', 'reasoning' or 'batch'.")
    requests: int = Field(description="Finished requests of the class since start.")
    goodput_requests: int = Field(description="Of those, the ones that met the class's SLO.")
    goodput_share: float | None = Field(description="goodput_requests / requests (null before any request).")


class OpsDegrade(BaseModel):
    enabled: bool
    level: int = Field(description="Steps in force: 0 none, up to len(steps).")
    step: str | None = Field(description="The highest step in force (null at level 0).")
    steps: list[str] = Field(description="The ladder's steps, lowest first.")


class OpsAutoscale(BaseModel):
    enabled: bool
    acting: bool = Field(False, description="Whether it starts and drains local replicas itself (else it only "
                                            "reports its wish on /metrics).")
    desired: int | None = None
    serving: int | None = None
    starting: int | None = None
    forecast_rps: float | None = Field(None, description="Arrivals per second it forecasts one start-up time "
                                                         "ahead.")
    min_replicas: int | None = None
    max_replicas: int | None = None


class OpsTierUsage(BaseModel):
    tier: str
    users: int = Field(description="Users of the tier with usage today.")
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int


class OpsSnapshot(BaseModel):
    time: float = Field(description="When the snapshot was taken, Unix seconds.")
    day: str = Field(description="The UTC day the usage figures are for.")
    ready: bool = Field(description="Whether the backend has its model loaded.")
    kv_cache_usage: float | None = Field(description="KV-cache occupancy, 0 to 1 (the fleet's mean behind a "
                                                     "router; null where unknown).")
    arrivals: int = Field(description="Requests that have come to the admission queue since start.")
    queue: OpsQueue
    classes: list[OpsClass]
    degrade: OpsDegrade
    autoscale: OpsAutoscale
    replicas: list[OpsReplica] = Field(description="The router's replicas (every model's, behind several "
                                                   "models); empty for a single backend.")
    usage_by_tier: list[OpsTierUsage]


def _totals(counter: Counter) -> list[tuple[dict[str, str], int]]:
    return [(s.labels, int(s.value)) for metric in counter.collect() for s in metric.samples
            if s.name.endswith("_total")]


def counts_by_label(counter: Counter) -> dict[str, int]:
    """A one-label counter's totals, by label value."""
    return {next(iter(labels.values())): n for labels, n in _totals(counter)}


def _backend_stats(ctx: AppContext) -> BackendStats | None:
    if not ctx.backend.ready:
        return None
    try:
        return ctx.backend.stats()
    except Exception:  # a backend between states: the page shows no load rather than failing
        return None


def _replicas(stats: BackendStats | None) -> list[ReplicaStatus]:
    """The router's replicas; behind a multi-model backend, every model's router's, in model order."""
    if stats is None:
        return []
    if stats.models:  # the top level repeats the default model's figures: read each model's once
        return [r for _, m in sorted(stats.models.items()) for r in (m.replicas or [])]
    return list(stats.replicas or [])


def _classes(ctx: AppContext) -> list[OpsClass]:
    m = ctx.traffic.metrics
    requests, good = counts_by_label(m.class_requests), counts_by_label(m.class_goodput_requests)
    return [OpsClass(name=name, requests=n, goodput_requests=good.get(name, 0),
                     goodput_share=good.get(name, 0) / n if n else None) for name, n in sorted(requests.items())]


def _autoscale(ctx: AppContext) -> OpsAutoscale:
    s = ctx.scaler
    if s is None:
        return OpsAutoscale(enabled=False)
    c = s.autoscaler.config
    return OpsAutoscale(enabled=True, acting=s.router is not None, desired=s.desired, serving=s.serving,
                        starting=s.starting, forecast_rps=s.autoscaler.expected_rps,
                        min_replicas=c.min_replicas, max_replicas=c.max_replicas)


def snapshot(ctx: AppContext, day: str, tiers: list[tuple[str, int, int, int, int, int]]) -> OpsSnapshot:
    """The snapshot now, with `tiers` the day's usage per tier (UsageRows.by_tier)."""
    t = ctx.traffic
    a = t.admission
    stats = _backend_stats(ctx)
    level = t.ladder.level if t.ladder is not None else 0
    return OpsSnapshot(
        time=time.time(), day=day, ready=stats is not None,
        kv_cache_usage=stats.kv_cache_usage_perc if stats is not None else None,
        arrivals=t.arrivals,
        queue=OpsQueue(waiting=a.waiting, running=a.running, max_running=a.max_running,
                       oldest_wait_s=a.oldest_wait_s(),
                       recent_wait_s=t.recent_wait.value() if t.recent_wait is not None else 0.0,
                       max_wait_s=a.max_wait_s, timeouts=sum(n for _, n in _totals(t.metrics.queue_timeouts))),
        classes=_classes(ctx),
        degrade=OpsDegrade(enabled=t.ladder is not None, level=level, step=STEPS[level - 1] if level else None,
                           steps=list(STEPS)),
        autoscale=_autoscale(ctx),
        replicas=[OpsReplica.of(r) for r in _replicas(stats)],
        usage_by_tier=[OpsTierUsage(tier=tier, users=users, requests=req, prompt_tokens=p, completion_tokens=c,
                                    cached_tokens=cached, total_tokens=p + c)
                       for tier, users, req, p, c, cached in tiers])
