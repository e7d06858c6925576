"""Where the router sends a request: policies over plain data, shared by the live router and the simulator.

A policy sees one `RouteRequest` (the prompt's full-block keys from engine/block_hash.py and its size)
and a `ReplicaState` per candidate replica (health, load, and how many of the prompt's leading blocks
that replica already holds). It returns the name of the chosen replica. Policies do no I/O and read no
clock, so `chatloom.sim` can drive exactly the code the live router runs (serving/router.py), in
simulated time, and a test can check that both choose alike for the same inputs.

Who fills `cached_blocks` is the caller's business: the live router from each replica's published
cache events (exact) or from what it sent there itself (approximate, for engines without a feed);
the simulator from its replicas' real KV-cache managers.
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


@dataclass(frozen=True)
class ReplicaState:
    name: str
    healthy: bool = True
    draining: bool = False
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by live sequences, 0..1
    num_running: int = 0
    num_waiting: int = 0
    cached_blocks: int = 0  # how many of the request's leading blocks this replica holds

    @property
    def accepts_work(self) -> bool:
        return self.healthy and not self.draining


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
