"""The routing policies: round_robin, least_load and prefix_aware, over the plain data of routing.py.

Why three: round_robin is the baseline every benchmark compares against; least_load spreads work by
what a replica really holds (KV blocks in use, requests queued inside it), not by request counts;
prefix_aware sends a conversation's next turn where its history already sits in the KV cache, so the
replica prefills only the new message, and falls back to the least loaded replica when the match is
poor or the load would go lopsided (SGLang's cache-aware router; llm-d's weighted scorers).

The load policies (least_load, prefix_aware) first keep the replicas expected to meet the request's
class target, when it has one (`meeting_target`); round_robin, the baseline, ignores targets.

Policies are pure: no I/O, no clock. A policy may keep a little state of its own (a round-robin
counter), which only ever changes in choose(), so the simulator and the live router stay in step.
"""
from __future__ import annotations

from typing import Sequence

from chatloom.serving.routing import (NoReplicaAvailable, PolicyWeights, ReplicaState, RouteRequest,
                                      RoutingPolicy)

# Weight of a request already running on a replica, relative to one waiting: a running request
# competes for the same steps but its prefill is (mostly) behind it. Overridable in weights.extra.
DEFAULT_RUNNING_WEIGHT = 0.05


def _candidates(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    live = [r for r in replicas if r.accepts_work]
    if not live:
        raise NoReplicaAvailable("no replica accepts work (all unhealthy or draining)")
    return live


def meeting_target(request: RouteRequest, live: list[ReplicaState]) -> list[ReplicaState]:
    """The replicas expected to give the first token within the request's target (those with no
    estimate yet included). All of them without a target, when none is expected to meet it, or when
    every replica has a queue: a saturated fleet gains nothing from moving work and loses the prefix
    cache's savings, which it needs most then."""
    target = request.ttft_target_s
    if target is None or all(r.num_waiting > 0 for r in live):
        return live
    return [r for r in live if r.expected_ttft_s is None or r.expected_ttft_s <= target] or live


def load_score(r: ReplicaState, weights: PolicyWeights) -> float:
    """How busy a replica is: KV blocks held by live sequences, then queued and running requests."""
    running = float(weights.extra.get("running", DEFAULT_RUNNING_WEIGHT))
    return weights.kv_usage * r.kv_cache_usage + weights.waiting * r.num_waiting + running * r.num_running


class RoundRobin(RoutingPolicy):
    """Each replica in turn, skipping those that do not accept work."""

    name = "round_robin"

    def __init__(self, weights: PolicyWeights | None = None) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        live = _candidates(replicas)
        chosen = live[self._next % len(live)]
        self._next += 1
        return chosen.name


class LeastLoad(RoutingPolicy):
    """The replica with the lowest load score; ties go round the replicas so an idle fleet spreads."""

    name = "least_load"

    def __init__(self, weights: PolicyWeights | None = None) -> None:
        self.weights = weights or PolicyWeights()
        self._tie = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        return self._least_loaded(meeting_target(request, _candidates(replicas)))

    def _least_loaded(self, live: list[ReplicaState]) -> str:
        scores = [load_score(r, self.weights) for r in live]
        best = min(scores)
        tied = [r for r, s in zip(live, scores) if s <= best + 1e-9]
        chosen = tied[self._tie % len(tied)]
        self._tie += 1
        return chosen.name


class PrefixAware(LeastLoad):
    """Score = prefix * (fraction of the prompt's blocks the replica holds) - load. When no replica
    holds at least `min_prefix_fraction` of the prompt, or when the best match is much busier than the
    least loaded replica (its waiting queue longer by `extra['balance_waiting']`, default 4), the
    request goes to the least loaded replica instead: a cache hit is not worth a long queue."""

    name = "prefix_aware"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        live = meeting_target(request, _candidates(replicas))
        total = len(request.block_keys)
        if total == 0:
            return self._least_loaded(live)
        w = self.weights
        hit = {r.name: min(r.cached_blocks, total) / total for r in live}
        if max(hit.values()) < w.min_prefix_fraction:
            return self._least_loaded(live)
        scored = sorted(live, key=lambda r: (-(w.prefix * hit[r.name] - load_score(r, w)), -hit[r.name]))
        best = scored[0]
        balance = float(w.extra.get("balance_waiting", 4))
        if best.num_waiting - min(r.num_waiting for r in live) > balance:
            return self._least_loaded(live)
        return best.name


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (RoundRobin, LeastLoad, PrefixAware)}


def make_policy(name: str, weights: PolicyWeights | None = None) -> RoutingPolicy:
    """A fresh policy by its settings name; ValueError names the known ones."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(weights)  # type: ignore[call-arg]
