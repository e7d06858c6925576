"""Where the router sends a request: policies over plain data, shared by the live router and the simulator.

A policy sees one `RouteRequest` (the prompt's full-block keys from engine/block_hash.py and its size)
and a `ReplicaState` per candidate replica (health, load, and how many of the prompt's leading blocks
that replica already holds). It returns the name of the chosen replica. Policies do no I/O and read no
clock, so `chatloom.sim` can drive exactly the code the live router runs (serving/router.py), in
simulated time, and a test can check that both choose alike for the same inputs.

Who fills `cached_blocks` is the caller's business: the live router from each replica's published
cache events (exact) or from what it sent there itself (approximate, for engines without a feed);
the simulator from its replicas' real KV-cache managers.

Class targets (a router's `class_targets`, off by default): a request may carry the time to first
token its traffic class has left (`ttft_target_s`), and a replica the time a new request is expected
to wait there for its first token (`expected_ttft_s`, from a `TtftEstimate` of its recent answers: its
queue, and the part of the prompt it would prefill). The load policies then choose among the replicas
expected to meet the target, so a chat message with a 2-second target leaves a replica whose queue
would make it miss, while work with a loose target (reasoning, batch) keeps its prefix locality there.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar, Sequence


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    block_keys: tuple[int, ...] = ()  # keys of the prompt's full blocks, in order
    model: str | None = None
    conversation_id: str | None = None  # a hint only; policies must not require it
    ttft_target_s: float | None = None  # what its class's time-to-first-token target leaves (None: no target)


@dataclass(frozen=True)
class ReplicaState:
    name: str
    healthy: bool = True
    draining: bool = False
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by live sequences, 0..1
    num_running: int = 0
    num_waiting: int = 0
    cached_blocks: int = 0  # how many of the request's leading blocks this replica holds
    expected_ttft_s: float | None = None  # a new request's expected wait for its first token (None: unknown)

    @property
    def accepts_work(self) -> bool:
        return self.healthy and not self.draining


class TtftEstimate:
    """How long a new request waits for its first token on one replica, learned from what it delivered.

    The model: time to first token = (requests waiting there) x the seconds one of them holds the queue
    + (prompt tokens to prefill there, those not in its prefix cache) x the seconds a token's prefill
    takes. A replica with nobody waiting has a free slot, so only the prefill counts. Each rate is a
    moving average of ratios: the prefill rate from answers sent when nobody waited, the queue's from
    the others, less their prefill. The prefill term keeps a request from leaving the replica that holds
    its history for one whose queue is shorter but where the whole prompt would be prefilled again.
    Pure: the caller brings the times, so the simulator keeps one per replica beside the live router's."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight  # of the newest sample in each moving average
        self.prefill_s_per_token: float | None = None
        self.queue_s_per_request: float | None = None

    def _average(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.weight * (sample - old)

    def observe(self, ttft_s: float, waiting_at_send: int, prefill_tokens: int) -> None:
        ttft_s = max(0.0, ttft_s)
        if waiting_at_send <= 0:
            self.prefill_s_per_token = self._average(self.prefill_s_per_token, ttft_s / max(1, prefill_tokens))
        else:
            prefill_s = (self.prefill_s_per_token or 0.0) * max(0, prefill_tokens)
            self.queue_s_per_request = self._average(self.queue_s_per_request,
                                                     max(0.0, ttft_s - prefill_s) / waiting_at_send)

    def expected(self, waiting: int, prefill_tokens: int) -> float | None:
        """None until the rate the estimate needs has been seen."""
        if self.prefill_s_per_token is None or (waiting > 0 and self.queue_s_per_request is None):
            return None
        return self.prefill_s_per_token * max(0, prefill_tokens) + (self.queue_s_per_request or 0.0) * max(0, waiting)


class NoReplicaAvailable(RuntimeError):
    """Every replica is unhealthy or draining."""


class RoutingPolicy(abc.ABC):
    """Chooses a replica. `name` is what settings and `chatloom bench router` call it."""

    name: ClassVar[str]

    @abc.abstractmethod
    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        """The name of the replica to send `request` to, among those that accept work.
        Raises NoReplicaAvailable when none does."""

    def routed(self, request: RouteRequest, replica: str) -> None:
        """Told after each placement (an approximate prefix index learns from it). Default: nothing."""


@dataclass
class PolicyWeights:
    """Weights of prefix_aware's score: prefix hit fraction against load (settings: [router])."""

    prefix: float = 1.0
    kv_usage: float = 0.5
    waiting: float = 0.25
    min_prefix_fraction: float = 0.1  # below this match, go to the least loaded replica
    extra: dict = field(default_factory=dict)
