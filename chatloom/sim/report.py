"""Figures from a simulation, with the engine's metric definitions (vLLM's): TTFT, TPOT =
(latency - TTFT) / (output tokens - 1), queue time, goodput = requests per second meeting every SLO.

Only requests that arrived after the warm-up and before the end count, so an empty fleet filling up
or the drain after the last arrival does not flatter or hurt the figures.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chatloom.sim.fleet import ReplicaStats
from chatloom.sim.request_table import REFUSED_CODES, RequestTable
from chatloom.sim.replica import SimRequest


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.05  # 20 tokens/s per stream, about reading speed
    attainment: float = 0.99  # the share of requests that must meet both (the planner's target)

    def met(self, r: SimRequest) -> bool:
        if r.finished is None or r.first_token is None:
            return False
        if r.first_token - r.arrival > self.ttft_s:
            return False
        n = len(r.answer)
        return n < 2 or (r.finished - r.first_token) / (n - 1) <= self.tpot_s


def _pct(values, scale: float = 1000.0) -> dict:
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = a * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": round(float(a.mean()), 3), "p50": round(float(p50), 3), "p90": round(float(p90), 3),
            "p99": round(float(p99), 3)}


def summarize(table: RequestTable, replicas: list[ReplicaStats], slo: SLO, warmup_s: float, end_s: float,
              fleet_size: int | None = None, tier_names: dict[int, str] | None = None) -> dict:
    """The figures of one run (or of several cells pooled): latency percentiles in ms, rates per second
    of the measured window (scaled to `fleet_size` when only a sample of its replicas was simulated),
    KV use from the replicas, prefix hits from the requests."""
    t = table
    window = max(end_s - warmup_s, 1e-9)
    sel = (t.arrival >= warmup_s) & (t.arrival < end_s)
    n = int(sel.sum())
    refused = sel & (t.refused > 0)
    done = sel & ~np.isnan(t.finished)
    ttft = (t.first_token - t.arrival)[done]
    multi = done & (t.output_tokens > 1)
    tpot = ((t.finished - t.first_token) / np.maximum(t.output_tokens - 1, 1))[multi]
    queue = (t.first_scheduled - t.arrival)[done]
    e2e = (t.finished - t.arrival)[done]
    meets = done & ((t.first_token - t.arrival) <= slo.ttft_s) & (
        (t.output_tokens < 2) | ((t.finished - t.first_token) / np.maximum(t.output_tokens - 1, 1) <= slo.tpot_s))
    good = int(meets.sum())
    simulated = len(replicas)
    fleet = fleet_size or simulated
    scale = fleet / max(simulated, 1)  # rates of the sample, scaled to the fleet
    prompt_tokens = int(t.prompt_tokens[done].sum())
    out_tokens = int(t.output_tokens[done].sum())
    busy = sum(r.busy_time for r in replicas)
    usage = sum(r.usage_time for r in replicas)
    reasons = {REFUSED_CODES[c]: int((refused & (t.refused == c)).sum()) for c in range(1, len(REFUSED_CODES))}
    by_tier = {}
    for prio in sorted(set(t.priority[sel].tolist())):
        ts = sel & (t.priority == prio)
        td = done & (t.priority == prio)
        name = (tier_names or {}).get(prio, f"priority {prio}")
        by_tier[name] = {"requests": int(ts.sum()), "completed": int(td.sum()),
                         "ttft_ms_p90": _pct((t.first_token - t.arrival)[td])["p90"],
                         "slo_attainment": round(float((meets & ts).sum() / ts.sum()), 4) if ts.sum() else None}
    return {
        "replicas": fleet, "replicas_simulated": simulated, "window_s": round(window, 3),
        "requests": n, "completed": int(done.sum()), "refused": int(refused.sum()),
        "refused_by_reason": {k: v for k, v in reasons.items() if v},
        "unfinished": n - int(done.sum()) - int(refused.sum()),
        "request_rate": round(n / window * scale, 4),
        "output_tokens_per_s": round(out_tokens / window * scale, 2),
        "output_tokens_per_s_per_replica": round(out_tokens / window / max(simulated, 1), 2),
        "ttft_ms": _pct(ttft), "tpot_ms": _pct(tpot), "queue_ms": _pct(queue), "e2e_ms": _pct(e2e),
        "slo": {"ttft_ms": slo.ttft_s * 1000, "tpot_ms": slo.tpot_s * 1000, "attainment": slo.attainment},
        "goodput_rps": round(good / window * scale, 4),
        "slo_attainment": round(good / n, 4) if n else None,
        "prefix_hit_rate": round(t.cached_tokens[done].sum() / prompt_tokens, 4) if prompt_tokens else None,
        "kv_usage_mean_while_busy": round(usage / busy, 4) if busy else 0.0,
        "tokens_per_step": round(sum(r.tokens_generated for r in replicas) / max(sum(r.steps for r in replicas), 1), 2),
        "kv_usage_peak": round(max((r.peak_usage for r in replicas), default=0.0), 4),
        "replica_busy_fraction": round(busy / max(sum(r.span_s for r in replicas), 1e-9), 4),
        "preemptions": int(t.preemptions[done].sum()),
        "reasoning_share": round(float(t.reasoning[sel].mean()), 4) if n else None,
        "by_tier": by_tier,
    }
