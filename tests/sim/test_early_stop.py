"""A probe stops once what it asks is known, and that is what the whole run gives: the verdict of a
run stopped once it certainly meets, the hit rate of one stopped once every request of its window
has its first token, the planner's answer with its probes stopped early and without."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from chatloom.serving.policies import make_policy
from chatloom.sim import planner as planner_mod
from chatloom.sim.early_stop import EarlyStop
from chatloom.sim.planner import meets, plan_fast, window_hit_rate
from chatloom.sim.report import SLO, summarize
from chatloom.sim.simulator import SimConfig, Simulator
from chatloom.sim.fleet import replica_stats
from test_simulator import small_spec, small_traffic

CFG = SimConfig(duration_s=20.0, warmup_s=4.0, seed=3, partial_block_hits=False)
TARGET = SLO(ttft_s=0.5, tpot_s=0.05, attainment=0.95)
NO_BUDGET = 10 ** 9  # no stop for misses: only the rule under test


def _rule(**kw) -> EarlyStop:
    return EarlyStop(TARGET.ttft_s, TARGET.tpot_s, CFG.warmup_s, CFG.duration_s, NO_BUDGET, **kw)


def _sim(rate: float, rule: EarlyStop | None) -> Simulator:
    return Simulator(small_spec(max_num_seqs=8), 2, make_policy("prefix_aware"), small_traffic(rate=rate), CFG,
                     keep_requests=False, early_stop=rule)


def _summary(run) -> dict:
    return summarize(run.table, replica_stats(run), TARGET, CFG.warmup_s, CFG.duration_s)


def _sorted_table(run) -> dict:
    t = run.table
    order = np.lexsort((t.prompt_tokens, t.arrival))
    return {f: getattr(t, f)[order] for f in t.__dataclass_fields__}


def test_a_run_stopped_once_it_certainly_meets_meets_and_resumes_to_the_same_run():
    full = _sim(10.0, _rule()).run()
    assert not full.stopped and meets(_summary(full), TARGET)
    sim = _sim(10.0, _rule(meets=TARGET.attainment))
    early = sim.run()
    assert early.stop_reason == "meets" and early.events < full.events
    assert any(np.isnan(early.table.finished))  # answers still streaming were left
    done = sim.resume(None)
    assert not done.stopped and done.events == full.events
    a, b = _sorted_table(done), _sorted_table(full)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert _summary(done) == _summary(full)


def test_a_run_that_misses_is_never_stopped_as_meeting():
    full = _sim(13.0, _rule()).run()
    s = _summary(full)
    assert not meets(s, TARGET) and s["refused"] == 0 and s["slo_attainment"] > 0.8  # just under, not refusing
    run = _sim(13.0, _rule(meets=TARGET.attainment)).run()
    assert not run.stopped and _summary(run) == s


@pytest.mark.parametrize("rate", [10.0, 30.0])
def test_the_hit_rate_is_known_once_every_request_of_the_window_has_its_first_token(rate):
    full = _sim(rate, _rule()).run()
    early = _sim(rate, _rule(first_tokens=True)).run()
    assert early.stop_reason == "first tokens" and early.events < full.events
    assert window_hit_rate(early.table, CFG.warmup_s, CFG.duration_s) == _summary(full)["prefix_hit_rate"]


def test_the_first_token_hook_counts_each_request_once(monkeypatch):
    # Preemption by recompute keeps a request's first token: a tight pool must not count it again.
    seen: list[str] = []
    orig = Simulator._first_token

    def spy(self, req, t):
        seen.append(req.rid)
        return orig(self, req, t)
    monkeypatch.setattr(Simulator, "_first_token", spy)
    sim = Simulator(small_spec(num_blocks=60, max_num_seqs=8), 1, None, small_traffic(rate=8.0), CFG,
                    early_stop=_rule())
    out = sim.run()
    assert sum(r.preemptions for r in out.requests) > 0
    assert len(seen) == len(set(seen))


def _without_shortcuts(**kw) -> EarlyStop:
    kw.pop("meets", None)
    kw.pop("first_tokens", None)
    return EarlyStop(**kw)


@pytest.mark.parametrize("rate, system_prompt", [(120.0, 64), (40.0, 800)])
def test_the_plan_is_the_same_with_its_probes_stopped_once_known(monkeypatch, rate, system_prompt):
    # The first walks down from the first probe's own size (taken on from its hit rate to its verdict),
    # the second from a smaller one (the long shared prompt's hits re-size the fleet); both end on a
    # probe stopped once it certainly met, then run on to its end.
    spec, cfg = small_spec(max_num_seqs=8), SimConfig(duration_s=30.0, warmup_s=6.0)
    traffic = small_traffic(rate=rate, system_prompt_tokens=system_prompt)
    seen: list[tuple[int, str]] = []
    fast = plan_fast(spec, traffic, "prefix_aware", TARGET, cfg, on_probe=lambda p: seen.append((p.replicas, p.stop_reason)))
    assert {"first tokens", "meets"} <= {why for _, why in seen}
    monkeypatch.setattr(planner_mod, "EarlyStop", lambda *a, **kw: _without_shortcuts(
        **dict(zip([f.name for f in dataclasses.fields(EarlyStop)], a)), **kw))
    slow = plan_fast(spec, traffic, "prefix_aware", TARGET, cfg)
    assert not any(p.stop_reason in ("first tokens", "meets") for p in slow.probes)
    assert fast.replicas == slow.replicas is not None
    assert [p.replicas for p in fast.probes] == [p.replicas for p in slow.probes]
    for f, s in zip(fast.probes, slow.probes):
        assert f.ok is None or f.ok == s.ok, (f, s)
    assert fast.best.stop_reason == "" and fast.best.summary == slow.best.summary
