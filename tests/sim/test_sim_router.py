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
