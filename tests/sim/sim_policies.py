"""Small routing policies for the simulator's tests only, until the serving room's policies are merged.

They implement chatloom.serving.routing.RoutingPolicy over the same plain data the live router uses;
they are not the product's policies (those live in chatloom/serving)."""
from __future__ import annotations

from chatloom.serving.routing import NoReplicaAvailable, RoutingPolicy


class FewestQueued(RoutingPolicy):
    """The replica with the fewest waiting, then running requests, then the lowest KV use."""

    name = "test_fewest_queued"

    def choose(self, request, replicas):
        live = [r for r in replicas if r.accepts_work]
        if not live:
            raise NoReplicaAvailable("none")
        return min(live, key=lambda r: (r.num_waiting, r.num_running, r.kv_cache_usage, r.name)).name


class MostCached(RoutingPolicy):
    """The replica holding most of the prompt's leading blocks; ties to the fewest queued."""

    name = "test_most_cached"

    def choose(self, request, replicas):
        live = [r for r in replicas if r.accepts_work]
        if not live:
            raise NoReplicaAvailable("none")
        return min(live, key=lambda r: (-r.cached_blocks, r.num_waiting, r.num_running, r.name)).name


class Rotate(RoutingPolicy):
    name = "test_rotate"

    def __init__(self):
        self.i = 0

    def choose(self, request, replicas):
        live = [r for r in replicas if r.accepts_work]
        if not live:
            raise NoReplicaAvailable("none")
        self.i += 1
        return live[(self.i - 1) % len(live)].name
