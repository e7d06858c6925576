"""The simulator on small fleets: every request finishes or is refused, KV is never over-committed,
the router sees each replica's real cache, and fast-forwarded runs give the same timings as
stepping one step at a time."""
from __future__ import annotations

import random

import pytest

from chatloom.sim import replica as replica_mod
from chatloom.sim.fleet import RequestTable, replica_stats, run_fleet
from chatloom.sim.hardware import ReplicaSpec
from chatloom.sim.replica import SimRequest
from chatloom.sim.report import SLO, summarize
from chatloom.sim.simulator import SimConfig, Simulator
from chatloom.sim.step_time import LinearStepTime
from chatloom.sim.arrivals import TrafficModel
from sim_policies import FewestQueued, MostCached, Rotate

STEP = LinearStepTime(coef={"const": 0.01, "decode_tokens": 0.0005, "prefill_tokens": 0.0001, "decode_ctx": 1e-7,
                            "prefill_attn": 1e-9, "prefill_seqs": 0.0002})


def small_spec(num_blocks=400, max_num_seqs=16, budget=256, max_model_len=2048):
    return ReplicaSpec(num_blocks=num_blocks, step_time=STEP, block_size=16, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, max_model_len=max_model_len, model_key="test")


def small_traffic(rate=6.0, **kw):
    base = dict(peak_rate=rate, mean_turns=3, think_time_s=2.0, system_prompt_tokens=64, user_median_tokens=40,
                answer_median_tokens=40, answer_sigma=0.6, reasoning_share=0.1, reasoning_median_tokens=300,
                max_answer_tokens=600)
    base.update(kw)
    return TrafficModel(**base)


def run(spec, n, policy, traffic, duration=30.0, **cfg):
    sim = Simulator(spec, n, policy, traffic, SimConfig(duration_s=duration, check_invariants=True, **cfg),
                    record_routes=True)
    return sim, sim.run()


@pytest.mark.parametrize("policy", [FewestQueued, MostCached, Rotate])
def test_every_request_finishes_or_is_refused_and_kv_is_never_overcommitted(policy):
    spec = small_spec()
    sim, out = run(spec, 3, policy(), small_traffic())
    assert len(out.requests) > 100
    for r in out.requests:
        assert (r.finished is not None) != (r.refused is not None), r
        if r.finished is not None:
            assert r.arrival <= r.first_scheduled <= r.first_token <= r.finished
    for rep in out.replicas:
        assert not rep.sched.has_work()
        assert rep.kv.num_free_blocks == rep.kv.num_blocks  # everything given back
        assert rep.max_blocks_held <= rep.kv.num_blocks
        assert rep.tokens_generated >= 0
    # Every answer token was produced exactly once, preemptions or not (but the first token of those
    # answering when the run began, made before it).
    done = [r for r in out.requests if r.finished is not None]
    assert sum(rep.tokens_generated for rep in out.replicas) >= sum(len(r.answer) - r.under_way for r in done)


def test_a_tight_pool_preempts_and_still_finishes_everything():
    spec = small_spec(num_blocks=70, max_num_seqs=32)  # 1,120 tokens of KV: long answers collide
    sim, out = run(spec, 2, FewestQueued(), small_traffic(rate=8.0, reasoning_share=0.3), duration=20.0,
                   queue_timeout_s=1e9)
    assert sum(rep.sched.num_preemptions for rep in out.replicas) > 0
    for r in out.requests:
        assert r.finished is not None or r.refused == "longer_than_kv_pool"


def test_overload_refuses_after_the_queue_timeout():
    spec = small_spec(max_num_seqs=2)
    sim, out = run(spec, 1, FewestQueued(), small_traffic(rate=20.0), duration=20.0, queue_timeout_s=3.0)
    refused = [r for r in out.requests if r.refused == "queue_timeout"]
    assert refused
    assert all(r.first_scheduled is None for r in refused)
    assert all((r.finished is not None) != (r.refused is not None) for r in out.requests)


def test_the_router_sees_each_replicas_real_prefix_cache():
    spec = small_spec()
    seen = []

    class Checking(MostCached):
        def choose(self, request, replicas):
            for state in replicas:
                kv = sim.by_name[state.name].kv
                # What the replica's KV-cache manager would reuse for these blocks right now.
                expect = 0
                for key in request.block_keys:
                    if key not in kv.pool.cached:
                        break
                    expect += 1
                assert state.cached_blocks == expect
                rep = sim.by_name[state.name]
                assert state.num_running == len(rep.sched.running)
                assert state.num_waiting == len(rep.sched.waiting)
                assert state.kv_cache_usage == rep.kv.usage
            seen.append(max(s.cached_blocks for s in replicas))
            return super().choose(request, replicas)

    sim = Simulator(spec, 3, Checking(), small_traffic(), SimConfig(duration_s=20.0))
    out = sim.run()
    assert max(seen) > 4  # later turns find their history cached somewhere
    # Prefix-aware placement pays off: most prompt tokens of later turns come from the cache.
    done = [r for r in out.requests if r.finished is not None]
    assert sum(r.cached_tokens for r in done) / sum(len(r.prompt) for r in done) > 0.3


def test_prefix_caching_off_means_no_hits():
    sim, out = run(small_spec(), 2, MostCached(), small_traffic(), enable_prefix_caching=False)
    assert all(r.cached_tokens == 0 for r in out.requests)


def _trace(n=60, seed=3):
    rng = random.Random(seed)
    t, reqs = 0.0, []
    shared = [rng.randrange(1000, 2000) for _ in range(48)]
    for i in range(n):
        t += rng.expovariate(8.0)
        prompt = shared + [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 200))]
        answer = [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 120))]
        reqs.append(SimRequest(f"t{i}", t, prompt, answer))
    return reqs


def test_fast_forward_gives_the_same_timings_as_single_steps(monkeypatch):
    spec = small_spec(num_blocks=120)
    outs = []
    for max_run in (replica_mod.MAX_RUN_STEPS, 1):
        monkeypatch.setattr(replica_mod, "MAX_RUN_STEPS", max_run)
        sim = Simulator(spec, 1, None, None, SimConfig(duration_s=100.0, check_invariants=True), trace=_trace())
        out = sim.run()
        outs.append({r.rid: (r.first_token, r.finished, r.cached_tokens, r.preemptions) for r in out.requests})
        steps = sum(r.steps for r in out.replicas)
    fast, slow = outs
    assert fast.keys() == slow.keys()
    for rid in fast:
        assert fast[rid][0] == pytest.approx(slow[rid][0], abs=1e-9), rid
        assert fast[rid][1] == pytest.approx(slow[rid][1], abs=1e-9), rid
        assert fast[rid][2:] == slow[rid][2:]


def test_a_fast_forwarded_answer_leaves_its_blocks_cached_for_the_next_turn(monkeypatch):
    # Each second turn resends its first turn and the answer; the engine publishes each block as it
    # fills, so the answer's blocks are cached even when its last steps ran as one fast-forwarded event.
    rng, reqs = random.Random(5), []
    for i in range(12):
        prompt = [rng.randrange(1000, 2000) for _ in range(rng.randint(20, 80))]
        answer = [rng.randrange(1000, 2000) for _ in range(rng.randint(60, 120))]
        reqs.append(SimRequest(f"a{i}", 0.5 * i, prompt, answer))
        reqs.append(SimRequest(f"b{i}", 60.0 + 0.5 * i, prompt + answer + [7, 8, 9], [1, 2]))
    cached = []
    for max_run in (replica_mod.MAX_RUN_STEPS, 1):
        monkeypatch.setattr(replica_mod, "MAX_RUN_STEPS", max_run)
        out = Simulator(small_spec(num_blocks=2000), 1, None, None, SimConfig(duration_s=100.0, check_invariants=True),
                        trace=[SimRequest(r.rid, r.arrival, list(r.prompt), list(r.answer)) for r in reqs]).run()
        cached.append({r.rid: r.cached_tokens for r in out.requests if r.rid.startswith("b")})
    fast, slow = cached
    assert fast == slow
    for r in reqs[1::2]:
        first = len(r.prompt) - 3
        assert fast[r.rid] >= (first - 2) // 16 * 16 > 0, r.rid  # the full blocks computed before the last step


def test_a_spread_step_model_widens_the_ttft_tail_and_repeats_exactly():
    spread = LinearStepTime(coef=STEP.coef, fit={"ratio_quantiles": [0.6, 0.8, 1.0, 1.4, 3.0]})
    runs = {}
    for name, model in (("flat", STEP), ("spread", spread), ("again", spread)):
        spec = ReplicaSpec(num_blocks=400, step_time=model, block_size=16, max_num_seqs=16, max_num_batched_tokens=256,
                           max_model_len=2048, model_key="test")
        out = Simulator(spec, 1, None, None, SimConfig(duration_s=100.0, check_invariants=True), trace=_trace()).run()
        runs[name] = sorted(r.first_token - r.arrival for r in out.requests)
    assert runs["spread"] == runs["again"]
    p90 = {k: v[int(0.9 * len(v))] for k, v in runs.items()}
    assert p90["spread"] > 1.2 * p90["flat"]


def test_summary_figures_follow_the_definitions():
    sim, out = run(small_spec(), 2, FewestQueued(), small_traffic(), duration=30.0)
    table = RequestTable.from_requests(out.requests)
    stats = replica_stats(out)
    s = summarize(table, stats, SLO(ttft_s=1.0, tpot_s=0.05), warmup_s=5.0, end_s=30.0)
    counted = [r for r in out.requests if 5.0 <= r.arrival < 30.0]
    assert s["requests"] == len(counted)
    assert s["completed"] + s["refused"] + s["unfinished"] == s["requests"]
    ttfts = sorted(r.first_token - r.arrival for r in counted if r.finished is not None)
    assert s["ttft_ms"]["p50"] == pytest.approx(1000 * (ttfts[(len(ttfts) - 1) // 2] + ttfts[len(ttfts) // 2]) / 2,
                                               abs=1e-3)
    good = sum(1 for r in counted if SLO(1.0, 0.05).met(r))
    assert s["goodput_rps"] == pytest.approx(good / 25.0, rel=1e-3)
    assert 0 <= s["prefix_hit_rate"] <= 1


def test_cells_pool_and_scale_rates():
    spec = small_spec()
    # Long enough that two cells' few conversations give a steady rate (20 s gave 4.1-11.2 over seeds).
    cfg = SimConfig(duration_s=120.0, warmup_s=5.0)
    res = run_fleet(spec, 8, FewestQueued, small_traffic(rate=8.0), cfg, cell_size=2, sample_cells=2)
    assert res.replicas_simulated == 4
    s = summarize(res.table, res.replicas, SLO(), 5.0, 120.0, fleet_size=8)
    # Two of four cells ran at a quarter of the traffic each: the pooled rate scales back to the fleet's.
    assert s["request_rate"] == pytest.approx(8.0, rel=0.35)


def test_bad_configurations_are_named():
    with pytest.raises(ValueError, match="at least one replica"):
        Simulator(small_spec(), 0, FewestQueued(), small_traffic(), SimConfig(duration_s=1))
    with pytest.raises(ValueError, match="needs a routing policy"):
        Simulator(small_spec(), 2, None, small_traffic(), SimConfig(duration_s=1))
    with pytest.raises(ValueError, match="positive"):
        TrafficModel(peak_rate=0)
    with pytest.raises(ValueError, match="no block"):
        small_spec(num_blocks=0)
