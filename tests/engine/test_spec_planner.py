"""The planner proposes where it pays and switches speculation off where it would slow
a step: at batch 1 with a weights-bound step and a good acceptance rate it proposes the
most it may; with a large batch whose step cost grows with every token, or proposals
that are seldom kept, it proposes nothing."""
from __future__ import annotations

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.sequence import Sequence
from chatloom.engine.spec_decode.planner import AcceptanceTracker, CostModel, plan_lengths
from chatloom.engine.spec_decode.proposer import NgramProposer


def cost(flat_until: int, base: float = 0.02, per_token: float = 0.001) -> CostModel:
    """A step is flat (weights-bound) up to `flat_until` tokens, then grows linearly."""
    model = CostModel()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        model.observe(n, base + per_token * max(0, n - flat_until))
    return model


def test_batch_one_weights_bound_proposes_all():
    assert plan_lengths([0.8], [4], cost(flat_until=16)) == [4]


def test_large_compute_bound_batch_switches_off():
    # 64 sequences; the step is already past the flat part, so each proposed token costs
    # about as much as a decoded one and brings less than one token.
    assert plan_lengths([0.7] * 64, [4] * 64, cost(flat_until=8)) == [0] * 64


def test_poor_acceptance_switches_off_even_at_batch_one():
    steep = cost(flat_until=0, base=0.02, per_token=0.004)  # each extra token costs 20% of a step
    assert plan_lengths([0.05], [4], steep) == [0]
    assert plan_lengths([0.9], [4], steep)[0] > 0


def test_better_sequences_get_longer_proposals():
    ks = plan_lengths([0.95, 0.3], [6, 6], cost(flat_until=4))
    assert ks[0] > ks[1]


def test_draft_cost_counts():
    free = plan_lengths([0.6], [4], cost(flat_until=16))
    draft = CostModel()
    for n in (1, 2, 4, 8):
        draft.observe(n, 0.015)  # each drafted position costs 75% of a target step
    assert sum(plan_lengths([0.6], [4], cost(flat_until=16), draft)) < sum(free)


def test_cost_model_ignores_a_stall():
    model = cost(flat_until=16)
    model.observe(6, 5.0)  # a stalled step on a busy machine, at a size not seen before
    assert model.seconds(6) <= model.seconds(8) + 1e-12


def test_acceptance_tracker_follows_the_sequence():
    t = AcceptanceTracker()
    for _ in range(10):
        t.record("good", 4, 4)
        t.record("bad", 4, 0)
    assert t.rate("good") > 0.8 > 0.3 > t.rate("bad")
    assert 0.2 < t.rate("new") < 0.8  # starts from the engine-wide rate


def test_acceptance_is_tracked_per_source():
    """Proposals from long n-gram matches are kept, those from one-token matches are not: a
    sequence's poor one-token record must not hold back its long matches, and a new sequence
    starts from each source's engine-wide rate."""
    t = AcceptanceTracker()
    for _ in range(10):
        t.record("a", 4, 4, source=4)
        t.record("a", 4, 0, source=1)
    assert t.rate("a", source=4) > 0.8 > 0.2 > t.rate("a", source=1)
    assert t.rate("new", source=4) > 0.8 > 0.2 > t.rate("new", source=1)
    assert 0.2 < t.rate("new", source=2) < 0.8  # no history for this source: the engine-wide rate
    t.forget("a")
    assert t.rate("a", source=1) == t.rate("new", source=1)


def test_ngram_proposals_name_their_match_length():
    seq = Sequence("a", [5, 1, 2, 3, 9, 1, 2, 3], SamplingParams())
    prop = NgramProposer(min_n=1, max_n=4).propose([seq], [2])[0]
    assert prop.tokens == [9, 1] and prop.source == 3
    seq.token_ids += [5]
    prop = NgramProposer(min_n=1, max_n=4).propose([seq], [2])[0]
    assert prop.tokens == [1, 2] and prop.source == 1


def test_engine_switches_off_when_tokens_cost_their_full_price(tiny_model):
    """With a cost model where every token costs a full step, the engine never speculates,
    and the answer is unchanged."""
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256, speculative="ngram"))
    engine.spec.cost = CostModel()  # uncalibrated: cost proportional to tokens
    engine.spec.observe_step = lambda n, s: None
    prompt = [5, 6, 7, 8] * 6
    out = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] == 0 and stats["spec_decode_plain_steps"] > 0
    plain = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    assert out[0].token_ids == plain.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                                              use_tqdm=False)[0].token_ids
