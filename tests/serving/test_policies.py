"""Routing policies over plain data: the same code the live router and the simulator run."""
import pytest

from chatloom.engine.block_hash import prefix_block_keys
from chatloom.serving.policies import POLICIES, make_policy
from chatloom.serving.prefix_index import PrefixIndex
from chatloom.serving.routing import NoReplicaAvailable, PolicyWeights, ReplicaState, RouteRequest


def req(n_blocks: int = 10) -> RouteRequest:
    keys = tuple(prefix_block_keys(list(range(16 * n_blocks)), 16, "m"))
    return RouteRequest(prompt_tokens=16 * n_blocks, block_keys=keys)


def test_factory_knows_three_policies_and_names_unknown_ones():
    assert set(POLICIES) == {"round_robin", "least_load", "prefix_aware"}
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown routing policy 'nope'.*round_robin"):
        make_policy("nope")


def test_round_robin_cycles_and_skips_unhealthy_and_draining():
    p = make_policy("round_robin")
    reps = [ReplicaState("a"), ReplicaState("b", healthy=False), ReplicaState("c"), ReplicaState("d", draining=True)]
    assert [p.choose(req(), reps) for _ in range(4)] == ["a", "c", "a", "c"]


def test_no_replica_accepting_work_raises():
    for name in POLICIES:
        with pytest.raises(NoReplicaAvailable):
            make_policy(name).choose(req(), [ReplicaState("a", healthy=False), ReplicaState("b", draining=True)])


def test_least_load_prefers_free_kv_and_short_queues_and_spreads_ties():
    p = make_policy("least_load")
    reps = [ReplicaState("a", kv_cache_usage=0.9), ReplicaState("b", kv_cache_usage=0.1),
            ReplicaState("c", kv_cache_usage=0.1, num_waiting=3)]
    assert p.choose(req(), reps) == "b"
    idle = [ReplicaState("a"), ReplicaState("b"), ReplicaState("c")]
    assert sorted(p.choose(req(), idle) for _ in range(3)) == ["a", "b", "c"]


def test_prefix_aware_goes_where_the_prefix_is():
    p = make_policy("prefix_aware")
    reps = [ReplicaState("a", cached_blocks=0), ReplicaState("b", cached_blocks=9, kv_cache_usage=0.3),
            ReplicaState("c", cached_blocks=2)]
    assert p.choose(req(), reps) == "b"


def test_prefix_aware_falls_back_to_least_load_on_poor_match_or_long_queue():
    p = make_policy("prefix_aware", PolicyWeights(min_prefix_fraction=0.5))
    poor = [ReplicaState("a", cached_blocks=2, kv_cache_usage=0.5), ReplicaState("b", cached_blocks=0)]
    assert p.choose(req(), poor) == "b"
    busy = [ReplicaState("a", cached_blocks=10, num_waiting=9), ReplicaState("b", cached_blocks=0)]
    assert p.choose(req(), busy) == "b"


def test_prefix_aware_weights_trade_hits_against_load():
    reps = [ReplicaState("a", cached_blocks=10, kv_cache_usage=0.95, num_running=4),
            ReplicaState("b", cached_blocks=5, kv_cache_usage=0.0)]
    assert make_policy("prefix_aware", PolicyWeights(prefix=1.0, kv_usage=0.1)).choose(req(), reps) == "a"
    assert make_policy("prefix_aware", PolicyWeights(prefix=1.0, kv_usage=2.0)).choose(req(), reps) == "b"


def test_prefix_index_counts_leading_keys_and_bounds_approximate_size():
    keys = prefix_block_keys(list(range(64)), 16, "m")
    idx = PrefixIndex()
    idx.add(keys[:3])
    assert idx.matched(keys) == 3
    idx.remove([keys[1]])
    assert idx.matched(keys) == 1  # a hole ends the usable prefix
    approx = PrefixIndex(capacity=2)
    approx.add(keys)
    assert len(approx) == 2 and approx.matched(keys) == 2  # the tail went first, the root side stays
    idx.replace(keys)
    assert idx.matched(keys) == 4


def test_a_tight_target_leaves_the_replica_whose_queue_would_miss_it_and_a_loose_one_stays():
    """The prefix sits on a replica expected to take 3 s to the first token; a chat message with 2 s
    left goes elsewhere, work with 10 s left (or no target) keeps the cache hit."""
    reps = [ReplicaState("a", cached_blocks=10, num_waiting=2, expected_ttft_s=3.0),
            ReplicaState("b", cached_blocks=0, num_waiting=0, expected_ttft_s=0.4)]
    tight, loose = (RouteRequest(160, req().block_keys, ttft_target_s=t) for t in (2.0, 10.0))
    for name in ("prefix_aware", "least_load"):
        assert make_policy(name).choose(tight, reps) == "b"
    assert make_policy("prefix_aware").choose(loose, reps) == "a"
    assert make_policy("prefix_aware").choose(req(), reps) == "a"
    unknown = [ReplicaState("a", cached_blocks=10, expected_ttft_s=None), ReplicaState("b", expected_ttft_s=0.1)]
    assert make_policy("prefix_aware").choose(tight, unknown) == "a"  # no estimate yet: not ruled out


def test_where_no_replica_is_expected_to_meet_the_target_or_all_have_queues_the_prefix_decides():
    """Moving work then only gives up the prefix cache's savings: the choice is the one without a target."""
    tight = RouteRequest(160, req().block_keys, ttft_target_s=1.0)
    missing = [ReplicaState("a", cached_blocks=10, num_waiting=1, expected_ttft_s=3.0),
               ReplicaState("b", num_waiting=0, expected_ttft_s=2.5)]
    queued = [ReplicaState("a", cached_blocks=10, num_waiting=3, expected_ttft_s=3.0),
              ReplicaState("b", num_waiting=1, expected_ttft_s=0.5)]
    for reps in (missing, queued):
        assert make_policy("prefix_aware").choose(tight, reps) == make_policy("prefix_aware").choose(req(), reps) == "a"


def test_the_ttft_estimate_learns_the_prefill_and_the_queue_apart():
    from chatloom.serving.routing import TtftEstimate

    est = TtftEstimate(weight=0.5)
    assert est.expected(0, 1000) is None
    est.observe(0.2, waiting_at_send=0, prefill_tokens=1000)  # 0.2 ms a prefilled token
    assert est.expected(0, 500) == pytest.approx(0.1)
    assert est.expected(2, 500) is None  # nothing known of its queue yet
    est.observe(2.2, waiting_at_send=2, prefill_tokens=1000)  # 1 s a request ahead, after the prefill
    assert est.expected(2, 500) == pytest.approx(2.1) and est.expected(0, 0) == 0
    est.observe(0.1, waiting_at_send=0, prefill_tokens=1000)  # the prefill rate moves half way
    assert est.expected(0, 1000) == pytest.approx(0.15)
