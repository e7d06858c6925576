"""The smallest fleet that meets an SLO, found by simulation, beside the seeds' arithmetic.

The search starts from a roofline guess (a replica's decode throughput at the batch its KV pool and
sequence cap allow), brackets the answer by doubling or halving, then bisects on the fleet size. Each
probe simulates a sample of cells at that fleet's per-cell share of the peak traffic. A fleet "meets"
the SLO when at least `attainment` of the measured requests get their first token within the TTFT
target and stream at the TPOT target, none refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from chatloom.sim.cost import batch_within, mean_request, replica_seconds
from chatloom.sim.early_stop import EarlyStop
from chatloom.sim.fleet import PolicySpec, cell_result, cell_simulator, run_fleet
from chatloom.sim.hardware import ReplicaSpec
from chatloom.sim.report import SLO, summarize
from chatloom.sim.simulator import SimConfig, Simulator
from chatloom.sim.step_time import BatchShape
from chatloom.sim.arrivals import TrafficModel


def replica_capacity(spec: ReplicaSpec, traffic: TrafficModel) -> dict:
    """Back-of-envelope decode throughput of one replica: the batch the KV pool and the sequence cap
    allow at the mean context, over the step time at that batch."""
    prompt, answer = mean_request(traffic, spec)
    ctx = prompt + answer / 2
    batch = int(max(1, min(spec.max_num_seqs, spec.pool_tokens // max(ctx + answer / 2, 1))))
    step = spec.step_time.step_time(BatchShape(batch, 0, int(batch * ctx), 0, 0))
    return {"batch": batch, "mean_context": round(ctx), "step_ms": round(step * 1000, 3),
            "tokens_per_s": round(batch / step, 1)}


@dataclass
class Probe:
    replicas: int
    ok: bool | None  # None: not judged (a probe that only measured the prefix hit rate)
    summary: dict
    stopped_early: bool = False  # ended once its answer was known; its figures cover what had ended
    stop_reason: str = ""  # then: "missed" (its miss budget spent), "meets" (certainly), "first tokens"


@dataclass
class PlanResult:
    replicas: int | None
    probes: list[Probe] = field(default_factory=list)
    estimate: dict = field(default_factory=dict)

    @property
    def best(self) -> Probe | None:
        return next((p for p in self.probes if p.replicas == self.replicas), None)


def meets(summary: dict, slo: SLO) -> bool:
    return (summary["requests"] > 0 and summary["refused"] == 0 and summary["unfinished"] == 0
            and summary["slo_attainment"] >= slo.attainment)


def plan_fleet(spec: ReplicaSpec, traffic: TrafficModel, policy: PolicySpec, slo: SLO, config: SimConfig,
               cell_size: int = 16, sample_cells: int = 1, processes: int = 1, tolerance: float = 0.03,
               max_replicas: int = 1_000_000, on_probe: Callable[[Probe], None] | None = None) -> PlanResult:
    est = replica_capacity(spec, traffic)
    peak_tokens = traffic.max_rate * traffic.mean_answer_tokens
    guess = max(1, math.ceil(peak_tokens / est["tokens_per_s"]))
    result = PlanResult(None, estimate={**est, "replicas": guess})
    tried: dict[int, Probe] = {}

    def probe(n: int) -> Probe:
        if n not in tried:
            res = run_fleet(spec, n, policy, traffic, config, cell_size=min(cell_size, n), sample_cells=sample_cells,
                            processes=processes)
            s = summarize(res.table, res.replicas, slo, config.warmup_s, config.duration_s, fleet_size=n)
            tried[n] = Probe(n, meets(s, slo), s)
            result.probes.append(tried[n])
            if on_probe:
                on_probe(tried[n])
        return tried[n]

    # Bracket: lo fails (0: nothing smaller to try), hi meets.
    if probe(guess).ok:
        lo, hi = 0, guess
        n = guess // 2
        while n >= 1:
            if not probe(n).ok:
                lo = n
                break
            hi, n = n, n // 2
    else:
        lo, n = guess, guess * 2
        while True:
            if n > max_replicas:
                return result  # no fleet up to the limit meets the SLO
            if probe(n).ok:
                hi = n
                break
            lo, n = n, n * 2
    # Bisect to the tolerance.
    while hi - lo > max(1, int(hi * tolerance)):
        mid = (lo + hi) // 2
        if probe(mid).ok:
            hi = mid
        else:
            lo = mid
    result.replicas = hi
    return result


def explain(seed_rows: list[dict], plan: PlanResult, spec: ReplicaSpec, traffic: TrafficModel,
            peak_tokens_per_s: float) -> list[str]:
    """Why the simulated fleet differs from the seeds' 2,500 servers, in numbers from this plan."""
    best = plan.best
    if best is None:
        return ["no fleet size up to the search limit met the SLO"]
    s = best.summary
    seed_servers = next(r["arithmetic"] for r in seed_rows if r["figure"].startswith("servers for this plan"))
    per_replica = s["output_tokens_per_s_per_replica"]
    lines = [
        f"throughput per replica: {per_replica:,.0f} tokens/s simulated against the seeds' 1,000 "
        f"(batch 32 x 32 ms); {plan.replicas:,} replicas against {seed_servers:,.0f}, "
        f"{plan.replicas / seed_servers:.2f}x",
        f"batching: the seeds cap a server at 32 conversations; this replica holds up to {spec.max_num_seqs} "
        f"sequences and {spec.pool_tokens:,} tokens of KV, and its step model gives "
        f"{plan.estimate['step_ms']:.1f} ms at batch {plan.estimate['batch']} (the seeds: 32 ms at 32)",
        f"prefix hits: {100 * (s['prefix_hit_rate'] or 0):.0f}% of prompt tokens came from the prefix cache, "
        f"prefill the seeds' arithmetic neither charges nor saves",
        f"reasoning tails: {100 * traffic.reasoning_share:.0f}% of requests are reasoning requests "
        f"(mean answer {traffic.mean_answer_tokens:.0f} tokens overall); e2e p99 {s['e2e_ms']['p99'] / 1000:.1f} s "
        f"against a p50 of {s['e2e_ms']['p50'] / 1000:.1f} s",
        f"headroom for the SLO: the fleet runs {100 * s['replica_busy_fraction']:.0f}% busy at the peak; the seeds "
        f"size for 100% of the average (no queueing, no burst x{traffic.burst_factor:g})",
    ]
    return lines


def slo_capacity(spec: ReplicaSpec, traffic: TrafficModel, tpot_s: float, prefix_hit: float) -> float:
    """Output tokens/s one replica serves at the SLO: the widest batch whose decode step meets the TPOT
    target, its prefill charged at the prefix hit rate (the step-time model the simulator uses)."""
    prompt, answer = mean_request(traffic, spec)
    batch = batch_within(spec, prompt + answer / 2, tpot_s)
    return answer / replica_seconds(spec, prompt, answer, batch, prefix_hit)


def plan_fast(spec: ReplicaSpec, traffic: TrafficModel, policy: PolicySpec, slo: SLO, config: SimConfig,
              probe_replicas: int = 4, max_probes: int = 6, step: float = 0.05, margin: float = 1.1,
              on_probe: Callable[[Probe], None] | None = None) -> PlanResult:
    """Size analytically, then confirm with short probes of one small cell at the per-replica load the
    answer implies. A probe's cost follows the requests of `probe_replicas` replicas, not the fleet's
    size, so the 2.5 M tokens/s question costs what a small peak does. The first probe measures the
    prefix hit rate, which re-sizes the fleet; later probes walk by `step` to the smallest size that
    meets the SLO (at most `max_probes` in all).

    Every probe stops once what it is asked is known (`EarlyStop`): the first once the window's hit
    rate is, the others once they certainly miss or certainly meet. A stopped probe is taken on to
    its end only where its verdict or its full figures are needed (the answer's probe)."""
    peak_tokens = traffic.max_rate * traffic.mean_answer_tokens
    est = replica_capacity(spec, traffic)
    guess = max(1, math.ceil(peak_tokens / slo_capacity(spec, traffic, slo.tpot_s, 0.0)))
    result = PlanResult(None, estimate={**est, "replicas": guess})
    tried: dict[int, Probe] = {}
    paused: dict[int, Simulator] = {}  # stopped probes that may still be taken on

    def stop_rule(n: int, **kw) -> EarlyStop:
        # A probe certainly misses once more of its window's requests missed the SLO than the
        # attainment allows of the requests the window should hold, with room for their count's noise.
        tr = traffic.scaled(min(probe_replicas, n) / n)
        window = config.duration_s - config.warmup_s
        expected = tr.rate((config.warmup_s + config.duration_s) / 2) * window
        return EarlyStop(slo.ttft_s, slo.tpot_s, config.warmup_s, config.duration_s,
                         math.ceil(1.5 * (1 - slo.attainment) * expected), **kw)

    def record(n: int, sim: Simulator, run) -> Probe:
        res = cell_result(run)
        s = summarize(res.table, res.replicas, slo, config.warmup_s, config.duration_s, fleet_size=n)
        if res.stop_reason == "first tokens":
            ok = None
            # Every request of the window has its first token, and with it its cached tokens; the
            # rest of the run would change none of them (what summarize counts over those it ended).
            s["prefix_hit_rate"] = window_hit_rate(res.table, config.warmup_s, config.duration_s)
        else:
            ok = res.stop_reason == "meets" or (not res.stopped and meets(s, slo))
        p = Probe(n, ok, s, res.stopped, res.stop_reason)
        if res.stop_reason in ("first tokens", "meets"):
            paused[n] = sim
        else:
            drop(n)
            sim.close()
        if n in tried:
            result.probes[result.probes.index(tried[n])] = p
        else:
            result.probes.append(p)
        tried[n] = p
        if on_probe:
            on_probe(p)
        return p

    def drop(n: int) -> None:
        if n in paused:
            paused.pop(n).close()

    def probe(n: int, **kw) -> Probe:
        """A first run of `n` (kw: the EarlyStop's optional rules), or a stopped one taken on to its verdict."""
        if n in paused and tried[n].ok is None:
            return record(n, paused[n], paused[n].resume(stop_rule(n, **kw)))
        if n not in tried:
            cell = min(probe_replicas, n)
            sim = cell_simulator(spec, cell, policy, traffic.scaled(cell / n), replace(config, seed=config.seed * 1000),
                                 name_prefix="c0r", early_stop=stop_rule(n, **kw))
            record(n, sim, sim.run())
        return tried[n]

    def finish(n: int) -> None:
        """The answer's probe, run to its end if it stopped once it certainly met: its full figures."""
        if n in paused:
            record(n, paused[n], paused[n].resume(None))
        for m in list(paused):
            drop(m)

    first = probe(guess, first_tokens=True)
    hit = float(first.summary.get("prefix_hit_rate") or 0.0)
    # The step model ignores queueing, so start a margin above its answer and walk down: probes of a
    # fleet that meets the SLO are cheap, an overloaded one piles up requests.
    n = min(guess, max(1, math.ceil(margin * peak_tokens / slo_capacity(spec, traffic, slo.tpot_s, hit))))
    if n != guess:
        drop(guess)  # its verdict is never needed
    if probe(n, meets=slo.attainment).ok:
        while len(tried) < max_probes:  # walk down while the next size still meets
            smaller = min(n - 1, math.floor(n * (1 - step)))
            if smaller < 1 or not probe(smaller, meets=slo.attainment).ok:
                break
            drop(n)
            n = smaller
        finish(n)
        result.replicas = n
    else:
        while len(tried) < max_probes:  # walk up to the first size that meets
            n = max(n + 1, math.ceil(n * (1 + step)))
            if probe(n).ok:  # the first to meet is the answer: run to its end
                result.replicas = n
                break
    return result


def window_hit_rate(table, start_s: float, end_s: float) -> float | None:
    """The share of prompt tokens the prefix cache held, over the requests of [start_s, end_s) that got
    their first token (rounded as summarize rounds it)."""
    sel = (table.arrival >= start_s) & (table.arrival < end_s) & ~np.isnan(table.first_token)
    prompt = int(table.prompt_tokens[sel].sum())
    return round(table.cached_tokens[sel].sum() / prompt, 4) if prompt else None
