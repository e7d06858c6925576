"""The simulator drives the serving room's own policies: replaying every recorded routing call
(the same RouteRequest and ReplicaStates, in order) through a fresh instance of the policy, as the
live router would call it, gives the same replica each time. Skipped until serving/policies.py exists."""
from __future__ import annotations

import pytest

from chatloom.sim.simulator import SimConfig, Simulator
from test_simulator import small_spec, small_traffic

policies = pytest.importorskip("chatloom.serving.policies")


@pytest.mark.parametrize("name", sorted(policies.POLICIES))
def test_simulated_choices_replay_identically_through_the_policy(name):
    sim = Simulator(small_spec(), 3, policies.make_policy(name), small_traffic(), SimConfig(duration_s=20.0),
                    record_routes=True)
    out = sim.run()
    # Every request but those answering when the run began (placed in a batch from the start) was routed.
    assert len(sim.routed) == sum(not r.under_way for r in out.requests) > 50
    live = policies.make_policy(name)
    for request, states, chosen in sim.routed:
        assert live.choose(request, list(states)) == chosen
        live.routed(request, chosen)
    if name == "prefix_aware":
        # Later turns were sent where their history was cached.
        assert sum(1 for request, states, chosen in sim.routed
                   if max(s.cached_blocks for s in states) > 2
                   and next(s for s in states if s.name == chosen).cached_blocks > 0) > 10


def test_with_class_targets_the_simulator_routes_as_the_live_router_does():
    """Requests carry their class's target, replicas the estimate the live router keeps (learned from
    first tokens), and the recorded choices replay through the policy; a chat request leaves the
    replica holding its history when that replica is expected to miss its target."""
    targets = {"interactive": 0.05, "reasoning": 10.0}
    sim = Simulator(small_spec(), 3, policies.make_policy("prefix_aware"), small_traffic(),
                    SimConfig(duration_s=20.0, ttft_targets=targets), record_routes=True)
    sim.run()
    carried = {r.ttft_target_s for r, _, _ in sim.routed}
    assert carried == {0.05, 10.0} or carried == {0.05}
    estimated = [states for _, states, _ in sim.routed if all(s.expected_ttft_s is not None for s in states)]
    assert len(estimated) > len(sim.routed) // 2  # every replica's estimate learned early in the run
    live = policies.make_policy("prefix_aware")
    left_the_cache = 0
    for request, states, chosen in sim.routed:
        assert live.choose(request, list(states)) == chosen
        if request.ttft_target_s is not None:
            fits = [s.name for s in states if s.expected_ttft_s is None or s.expected_ttft_s <= request.ttft_target_s]
            assert not fits or chosen in fits
            home = max(states, key=lambda s: s.cached_blocks)
            left_the_cache += home.cached_blocks > 2 and home.name not in fits and chosen != home.name
    assert left_the_cache > 5
