"""The traffic classes of a simulated day and the replica time each request takes, degraded or not.

Each class (interactive per tier, reasoning, batch) has a share of the arrivals, an admission
priority, a TTFT target from traffic.slo_classes and a mean request (prompt tokens, the share of them
the prefix cache holds, a lognormal answer length). A request's work is the replica time it takes on
the fleet's model, from the step-time model (`cost.replica_seconds`: its share of decode steps at the
batch that meets the TPOT target, plus its prefill).

The degrade ladder's steps change that work as they would change the request:

- `effort`: a reasoning request thinks for the capped effort's budget instead of the asked one;
- `small_model`: the chosen tiers' requests run on the smaller model, whose replica time comes from its
  own step-time model and is counted in the big model's replicas by GPU count (a 1-GPU replica's second
  is 1/8 of an 8-GPU replica's), as if both models drew on one pool of GPUs;
- `max_tokens`: the chosen tiers' answers are cut at the cap (the mean of a lognormal cut there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from chatloom.serving.degrade import STEPS
from chatloom.settings.tree import DegradeSettings, TrafficSettings
from chatloom.sim.cost import batch_within, prefill_seconds, replica_seconds
from chatloom.sim.hardware import ReplicaSpec

EFFORTS = ("low", "medium", "high")
# Thinking tokens per effort: the budgets app/traffic/reasoning.py gives the model (a test checks).
THINKING_TOKENS = {"low": 256, "medium": 1024, "high": 4096}


@dataclass(frozen=True)
class DayClass:
    name: str                  # the SLO class: interactive:<tier>, reasoning or batch
    tier: str
    share: float               # of the arrivals
    priority: int              # admission order: lower first
    prompt_tokens: float = 2000.0
    prefix_hit: float = 0.7    # share of the prompt the prefix cache holds
    answer_median: float = 360.0
    answer_sigma: float = 0.8
    effort: str | None = None  # reasoning requests: the effort asked for

    @property
    def kind(self) -> str:
        return self.name.partition(":")[0]


# The default mix: most requests are the free tier's; reasoning requests come from the paid tiers;
# batch lines are served last (the admission queue's batch class), which is what defers them.
DEFAULT_CLASSES = (
    DayClass("interactive:pro", "pro", 0.10, 0),
    DayClass("interactive:plus", "plus", 0.25, 1),
    DayClass("reasoning", "plus", 0.10, 2, effort="medium"),
    DayClass("interactive:free", "free", 0.45, 3),
    DayClass("batch", "free", 0.10, 4, prompt_tokens=1000.0, prefix_hit=0.3),
)


def lognormal_mean_below(median: float, sigma: float, cap: float | None = None) -> float:
    """E[min(X, cap)] for X lognormal with this median and sigma (cap None: E[X])."""
    mu = math.log(median)
    mean = math.exp(mu + sigma ** 2 / 2)
    if cap is None:
        return mean
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    z = (math.log(cap) - mu) / sigma
    return mean * phi(z - sigma) + cap * (1 - phi(z))


def share_above(median: float, sigma: float, cap: float) -> float:
    """P(X > cap) for X lognormal: the share of answers a max_tokens cap shortens."""
    return 0.5 * (1 - math.erf((math.log(cap) - math.log(median)) / sigma / math.sqrt(2)))


def ttft_target(traffic: TrafficSettings, c: DayClass) -> float:
    """The class's TTFT target: its own entry in traffic.slo_classes, else interactive's, else slo_ttft_s."""
    classes = traffic.slo_classes
    for key in (c.name, c.kind):
        if key in classes and classes[key].ttft_s is not None:
            return classes[key].ttft_s
    if traffic.slo_ttft_s is None:
        raise ValueError(f"no TTFT target for the {c.name} class (traffic.slo_ttft_s or traffic.slo_classes)")
    return traffic.slo_ttft_s


def tpot_target(traffic: TrafficSettings, classes: tuple[DayClass, ...]) -> float:
    """The strictest TPOT target of the classes: the fleet runs every replica at the batch that meets it."""
    found = []
    for c in classes:
        t = next((traffic.slo_classes[k].tpot_s for k in (c.name, c.kind) if k in traffic.slo_classes
                  and traffic.slo_classes[k].tpot_s is not None), traffic.slo_tpot_s)
        if t is not None:
            found.append(t)
    if not found:
        raise ValueError("no TPOT target (traffic.slo_tpot_s or traffic.slo_classes)")
    return min(found)


@dataclass(frozen=True)
class ClassWork:
    """A class's work at each ladder level (0: none of the steps; i: the first i steps), in seconds of
    one of the fleet's replicas, and what each step changes for it."""

    name: str
    ttft_s: float
    priority: int
    share: float
    work: tuple[float, ...]        # replica-seconds per request, index: ladder level
    prefill_s: tuple[float, ...]   # the request's own prefill time, index: ladder level (part of its TTFT)
    affected: tuple[float, ...]    # per step: the share of this class's requests the step changes


def class_work(c: DayClass, traffic: TrafficSettings, degrade: DegradeSettings, big: ReplicaSpec,
               small: ReplicaSpec | None, tpot_s: float) -> ClassWork:
    """What one request of class `c` costs at each level of the ladder."""
    def cost(spec: ReplicaSpec, answer: float) -> tuple[float, float]:
        ctx = c.prompt_tokens + answer / 2
        batch = batch_within(spec, ctx, tpot_s)
        scale = spec.gpus / big.gpus  # in the big model's replica-seconds
        return (replica_seconds(spec, c.prompt_tokens, answer, batch, c.prefix_hit) * scale,
                prefill_seconds(spec, c.prompt_tokens, c.prefix_hit))

    answer = lognormal_mean_below(c.answer_median, c.answer_sigma)
    capped_effort = EFFORTS[min(EFFORTS.index(c.effort), EFFORTS.index(degrade.effort_cap))] if c.effort else None
    on_small = small is not None and degrade.small_model is not None and c.tier in degrade.small_model_tiers \
        and c.kind != "batch"
    capped = c.tier in degrade.max_tokens_tiers and c.kind != "batch"
    works, prefills = [], []
    for level in range(len(STEPS) + 1):
        effort = capped_effort if c.effort and level >= 1 else c.effort
        tokens = (THINKING_TOKENS[effort] if effort else 0.0) + (
            lognormal_mean_below(c.answer_median, c.answer_sigma, degrade.max_tokens_cap)
            if capped and level >= 3 else answer)
        w, p = cost(small if on_small and level >= 2 else big, tokens)
        works.append(w)
        prefills.append(p)
    affected = (1.0 if c.effort and capped_effort != c.effort else 0.0,
                1.0 if on_small else 0.0,
                share_above(c.answer_median, c.answer_sigma, degrade.max_tokens_cap) if capped else 0.0)
    return ClassWork(c.name, ttft_target(traffic, c), c.priority, c.share, tuple(works), tuple(prefills), affected)


def day_classes(traffic: TrafficSettings, degrade: DegradeSettings, big: ReplicaSpec, small: ReplicaSpec | None,
                classes: tuple[DayClass, ...] = DEFAULT_CLASSES) -> list[ClassWork]:
    total = sum(c.share for c in classes)
    if abs(total - 1) > 1e-6:
        raise ValueError(f"the classes' shares of the arrivals add up to {total:g}, not 1")
    tpot = tpot_target(traffic, classes)
    return sorted((class_work(c, traffic, degrade, big, small, tpot) for c in classes), key=lambda w: w.priority)
