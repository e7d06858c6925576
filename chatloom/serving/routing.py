"""Where the router sends a request: policies over plain data, shared by the live router and the simulator.

A policy sees one `RouteRequest` (the prompt's full-block keys from engine/block_hash.py and its size)
and a `ReplicaState` per candidate replica (health, load, and how many of the prompt's leading blocks
that replica already holds). It returns the name of the chosen replica. Policies do no I/O and read no
clock, so `chatloom.sim` can drive exactly the code the live router runs (serving/router.py), in
simulated time, and a test can check that both choose alike for the same inputs.

Who fills `cached_blocks` is the caller's business: the live router from each replica's published
cache events (exact) or from what it sent there itself (approximate, for engines without a feed);
the simulator from its replicas' real KV-cache managers.

Class targets: a request may carry the time to first token its traffic class has left
(`ttft_target_s`), and a replica the time a new request is expected to wait there for its first
token (`expected_ttft_s`, from a `TtftEstimate` of what that replica has lately delivered). The load
policies then choose among the replicas expected to meet the target, so a chat message with a 2-second
target leaves a replica whose queue would make it miss, while work with a loose target (reasoning,
batch) keeps its prefix locality there.
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

    Each observation is a request's time to first token and the requests that were waiting there when
    it was sent; the estimate keeps a moving average of the seconds per place in the queue (the request's
    own place included), so the expected wait of the next request is that times (1 + waiting now).
    Pure: the caller brings the times, so the simulator can keep one beside the live router."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight  # of the newest observation in the moving average
        self.per_place_s: float | None = None

    def observe(self, ttft_s: float, waiting_at_send: int) -> None:
        sample = max(0.0, ttft_s) / (1 + max(0, waiting_at_send))
        self.per_place_s = sample if self.per_place_s is None else \
            self.per_place_s + self.weight * (sample - self.per_place_s)

    def expected(self, waiting: int) -> float | None:
        return None if self.per_place_s is None else self.per_place_s * (1 + max(0, waiting))


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
