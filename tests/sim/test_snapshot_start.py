"""A run starts at the traffic's steady state (the conversations under way, their histories cached,
answers in flight), keeps only each ended request's figures when asked, and stops once a miss
budget is spent."""
from __future__ import annotations

import numpy as np
import pytest

from chatloom.serving.policies import make_policy
from chatloom.sim.early_stop import EarlyStop
from chatloom.sim.simulator import SimConfig, Simulator
from sim_policies import FewestQueued
from test_simulator import small_spec, small_traffic

WINDOW = 20.0


def _window_figures(snapshot: bool, prewarm: float | None, seed: int) -> tuple[float, float, float]:
    sim = Simulator(small_spec(), 4, make_policy("prefix_aware"), small_traffic(rate=20.0),
                    SimConfig(duration_s=WINDOW, seed=seed, snapshot=snapshot, prewarm_s=prewarm,
                              partial_block_hits=False))
    out = sim.run()
    sent = [r for r in out.requests if 0 <= r.arrival < WINDOW]
    done = [r for r in sent if r.finished is not None]
    return (len(sent) / WINDOW, float(np.mean([len(r.prompt) for r in sent])),
            sum(r.cached_tokens for r in done) / sum(len(r.prompt) for r in done))


def _mean_over_seeds(snapshot: bool, prewarm: float | None) -> np.ndarray:
    return np.mean([_window_figures(snapshot, prewarm, seed) for seed in range(3)], axis=0)


def test_a_snapshot_start_matches_a_long_cold_start_after_a_short_warm_up():
    # The reference: traffic from an empty fleet, 50 s (five conversation lifetimes) before.
    ref = _mean_over_seeds(False, 50.0)
    short = Simulator(small_spec(), 4, make_policy("prefix_aware"), small_traffic(rate=20.0),
                      SimConfig(duration_s=WINDOW)).prewarm_s()
    assert short < 5.0
    snap = _mean_over_seeds(True, None)
    cold = _mean_over_seeds(False, short)
    rate, prompt, hits = np.abs(snap / ref - 1)
    assert rate < 0.12 and prompt < 0.08 and hits < 0.15, (snap, ref)
    # The same short warm-up from an empty fleet is far off: fewer and shorter prompts, more hits.
    rate, prompt, _ = cold / ref - 1
    assert rate < -0.2 and prompt < -0.15, (cold, ref)


def test_answers_under_way_at_the_start_run_in_the_batch_and_end():
    sim = Simulator(small_spec(), 3, FewestQueued(), small_traffic(rate=20.0),
                    SimConfig(duration_s=10.0, check_invariants=True))
    out = sim.run()
    under_way = [r for r in out.requests if r.under_way]
    assert len(under_way) > 5
    assert all(r.arrival < -sim.prewarm_s() and r.finished is not None for r in under_way)
    # Their conversations go on: some send a later message inside the run.
    convs = {id(r.conversation) for r in under_way}
    assert any(id(r.conversation) in convs for r in out.requests if not r.under_way)


def test_a_run_that_keeps_no_requests_gives_the_same_table():
    def run(keep: bool):
        sim = Simulator(small_spec(), 2, FewestQueued(), small_traffic(rate=10.0), SimConfig(duration_s=15.0, seed=4),
                        keep_requests=keep)
        return sim.run()
    kept, dropped = run(True), run(False)
    assert not dropped.requests and len(dropped.table) == len(kept.requests) > 50
    a, b = kept.table, dropped.table
    order_a, order_b = np.argsort(a.arrival, kind="stable"), np.argsort(b.arrival, kind="stable")
    for name in a.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a, name)[order_a], getattr(b, name)[order_b], err_msg=name)


@pytest.mark.parametrize("rate, stops", [(60.0, True), (2.0, False)])
def test_a_spent_miss_budget_stops_the_run(rate, stops):
    budget = EarlyStop(ttft_s=1.0, tpot_s=0.1, start_s=2.0, end_s=20.0, misses=10)
    cfg = SimConfig(duration_s=20.0, warmup_s=2.0)
    sim = Simulator(small_spec(max_num_seqs=8), 1, None, small_traffic(rate=rate), cfg, early_stop=budget)
    out = sim.run()
    assert out.stopped is stops
    missed = sum(budget.missed(r) for r in out.requests if r.finished is not None or r.refused is not None)
    if stops:
        assert missed == 11  # stopped at the first miss over the budget
        assert any(r.finished is None and r.refused is None for r in out.requests)  # in flight, unfinished
    else:
        assert missed <= 10
