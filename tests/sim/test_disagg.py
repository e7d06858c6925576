"""Disaggregated prefill/decode pools: every request still finishes, KV is never over-committed in
either pool, each multi-token answer crosses the link once, and the transfer shows in its timing."""
from __future__ import annotations

import pytest

from chatloom.sim.disagg import DisaggSimulator
from chatloom.sim.hardware import ReplicaSpec
from chatloom.sim.simulator import SimConfig
from sim_policies import FewestQueued, MostCached
from test_simulator import STEP, small_traffic


def spec(num_blocks=400):
    return ReplicaSpec(num_blocks=num_blocks, step_time=STEP, block_size=16, max_num_seqs=16,
                       max_num_batched_tokens=256, max_model_len=2048, model_key="test", kv_bytes_per_token=1000)


def test_disaggregated_pools_finish_everything():
    sim = DisaggSimulator(spec(), 1, 2, MostCached(), FewestQueued(), small_traffic(rate=6.0),
                          SimConfig(duration_s=30.0, check_invariants=True), link_bytes_per_s=1e6)
    out = sim.run()
    assert len(out.requests) > 100
    for r in out.requests:
        assert (r.finished is not None) != (r.refused is not None)
    # Those answering when the run began were placed in the decode pool, not sent over the link.
    multi = [r for r in out.requests if r.finished is not None and len(r.answer) > 1 and not r.under_way]
    assert sim.transfers == len(multi)
    assert all(r.replica.startswith("d") for r in multi)  # decoded in the decode pool
    for rep in sim.replicas:
        assert not rep.sched.has_work() and rep.kv.num_free_blocks == rep.kv.num_blocks
    # 1 MB/s and 1 KB per token: a prompt of P tokens waits P ms before its second token at least.
    for r in multi:
        second_token_earliest = r.first_token + len(r.prompt) * 1000 / 1e6
        assert r.finished >= second_token_earliest


def test_decode_pool_full_waits_instead_of_overcommitting():
    sim = DisaggSimulator(spec(num_blocks=60), 2, 1, FewestQueued(), FewestQueued(),
                          small_traffic(rate=10.0, reasoning_share=0.3), SimConfig(duration_s=15.0, check_invariants=True,
                                                                              queue_timeout_s=1e9))
    out = sim.run()
    assert all(r.finished is not None or r.refused == "longer_than_kv_pool" for r in out.requests)


def test_bad_disaggregation_settings():
    with pytest.raises(ValueError, match="at least one prefill"):
        DisaggSimulator(spec(), 0, 1, FewestQueued(), FewestQueued(), small_traffic(), SimConfig(duration_s=1))
    with pytest.raises(ValueError, match="KV bytes per token"):
        DisaggSimulator(ReplicaSpec(num_blocks=10, step_time=STEP), 1, 1, FewestQueued(), FewestQueued(),
                        small_traffic(), SimConfig(duration_s=1))
