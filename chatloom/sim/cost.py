"""What a planned fleet costs per million output tokens, and what batching and prefix caching save.

A replica's time per request is its share of the decode steps (a step of batch b serves b streams)
plus the prefill of the prompt tokens the prefix cache does not hold, both from the fitted step-time
model the simulator uses. Cost per million output tokens is that time at the hardware's price.
"""
from __future__ import annotations

import math

from chatloom.sim.arrivals import TrafficModel
from chatloom.sim.hardware import ReplicaSpec
from chatloom.sim.step_time import BatchShape


def mean_request(traffic: TrafficModel, spec: ReplicaSpec) -> tuple[float, float]:
    """(mean prompt tokens, mean answer tokens) of the traffic, the prompt capped by the context."""
    answer = traffic.mean_answer_tokens
    prompt = traffic.system_prompt_tokens + traffic.mean_turns * (traffic.user_median_tokens + answer) / 2
    return min(prompt, spec.max_model_len - answer / 2), answer


def decode_step_s(spec: ReplicaSpec, traffic: TrafficModel) -> float:
    """The decode step of the largest batch the KV pool and the sequence cap allow at the mean context:
    about the time a loaded replica takes per answer token."""
    prompt, answer = mean_request(traffic, spec)
    ctx = prompt + answer / 2
    batch = int(max(1, min(spec.max_num_seqs, spec.pool_tokens // max(ctx + answer / 2, 1))))
    return spec.step_time.step_time(BatchShape(batch, 0, int(batch * ctx), 0, 0))


def loaded_step_s(spec: ReplicaSpec, traffic: TrafficModel, rate: float) -> float:
    """The decode step of a replica taking `rate` messages per second, by Little's law: its batch is
    the rate times an answer's length in steps, each step also prefilling the new messages that
    arrive meanwhile (their history assumed cached). Solved by iteration; at most the full batch."""
    prompt, answer = mean_request(traffic, spec)
    ctx = prompt + answer / 2
    user = traffic.user_median_tokens * math.exp(traffic.user_sigma ** 2 / 2)
    full = int(max(1, min(spec.max_num_seqs, spec.pool_tokens // max(ctx + answer / 2, 1))))
    step, batch = decode_step_s(spec, traffic), 1.0
    for _ in range(50):
        step = spec.step_time.step_time(BatchShape(int(round(batch)), int(rate * step * user), int(batch * ctx),
                                                   0.0, int(math.ceil(rate * step))))
        nxt = min(full, max(1.0, rate * answer * step))
        if abs(nxt - batch) < 0.01:
            break
        batch = nxt
    return step


def slo_batch(spec: ReplicaSpec, traffic: TrafficModel, tpot_s: float) -> int:
    """The largest batch whose decode step meets the TPOT target (at least 1), within what the KV pool
    and the sequence cap allow at the mean context."""
    prompt, answer = mean_request(traffic, spec)
    return batch_within(spec, prompt + answer / 2, tpot_s)


def batch_within(spec: ReplicaSpec, ctx: float, tpot_s: float) -> int:
    """The largest batch (at least 1) of streams at context `ctx` whose decode step meets `tpot_s`,
    within what the KV pool and the sequence cap allow."""
    cap = int(max(1, min(spec.max_num_seqs, spec.pool_tokens // max(ctx, 1))))
    best = 1
    for b in range(1, cap + 1):
        if spec.step_time.step_time(BatchShape(b, 0, int(b * ctx), 0, 0)) <= tpot_s:
            best = b
        else:
            break
    return best


def replica_seconds_per_request(spec: ReplicaSpec, traffic: TrafficModel, batch: int, prefix_hit: float) -> float:
    """Replica time one mean request takes: its share of `batch`-wide decode steps, plus the prefill of
    the part of its prompt the prefix cache does not hold (`prefix_hit`, a share of prompt tokens)."""
    prompt, answer = mean_request(traffic, spec)
    return replica_seconds(spec, prompt, answer, batch, prefix_hit)


def replica_seconds(spec: ReplicaSpec, prompt: float, answer: float, batch: int, prefix_hit: float) -> float:
    """Replica time of a request of `prompt` and `answer` tokens: decode at `batch` plus its prefill."""
    ctx = prompt + answer / 2
    decode = answer * spec.step_time.step_time(BatchShape(batch, 0, int(batch * ctx), 0, 0)) / batch
    return decode + prefill_seconds(spec, prompt, prefix_hit)


def prefill_seconds(spec: ReplicaSpec, prompt: float, prefix_hit: float) -> float:
    """The marginal time of prefilling the part of a prompt the prefix cache does not hold."""
    cached = prompt * prefix_hit
    fresh = max(prompt - cached, 1.0)
    # Chunked prefill rides along decode steps, so a prompt adds its marginal time, not a step's overhead.
    return (spec.step_time.step_time(BatchShape(0, int(fresh), 0, fresh * (cached + (fresh + 1) / 2), 1))
            - spec.step_time.step_time(BatchShape()))


def cost_report(spec: ReplicaSpec, traffic: TrafficModel, replicas: int, gpu_hour_price: float,
                tpot_s: float, prefix_hit: float) -> dict:
    """Cost per million output tokens at the planned load (the whole fleet over the peak's output)
    and at the SLO (every replica as busy as the TPOT target allows), and the saving from batching
    (against batch 1) and from prefix caching (against no hits), both at the SLO's batch."""
    replica_hour = gpu_hour_price * spec.gpus
    _, answer = mean_request(traffic, spec)
    peak_tokens_per_s = traffic.peak_rate * traffic.mean_answer_tokens

    def per_million(batch: int, hit: float) -> float:
        seconds_per_token = replica_seconds_per_request(spec, traffic, batch, hit) / answer
        return replica_hour / 3600 * seconds_per_token * 1e6

    batch = slo_batch(spec, traffic, tpot_s)
    at_slo = per_million(batch, prefix_hit)
    unbatched = per_million(1, prefix_hit)
    uncached = per_million(batch, 0.0)
    return {
        "gpu_hour_price": gpu_hour_price,
        "fleet_cost_per_hour": round(replicas * replica_hour, 2),
        "per_million_output_tokens_at_planned_load": round(replicas * replica_hour / (peak_tokens_per_s * 3600) * 1e6, 4),
        "per_million_output_tokens_at_slo": round(at_slo, 4),
        "slo_batch": batch,
        "output_tokens_per_replica_second_at_slo": round(
            answer / replica_seconds_per_request(spec, traffic, batch, prefix_hit), 1),
        "batching_saving": round(1 - at_slo / unbatched, 4) if unbatched else None,
        "prefix_caching_saving": round(1 - at_slo / uncached, 4) if uncached else None,
        "prefix_hit_rate": round(prefix_hit, 4),
    }
