"""Sampled speculative decoding keeps the target's distribution exactly.

A chi-square test over many seeded draws of the first token that speculation decides
(the second of each answer) passes with the engine's acceptance rule and fails with a
deliberately wrong one: catching the wrong rule shows the test has the power to fail.
Seeds stay reproducible: with deterministic proposals each emitted token uses one draw
of the request's own stream, so speculation on or off gives the same text."""
from __future__ import annotations

import pytest
import torch

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.sampler import draw_token
from chatloom.engine.spec_decode.proposer import Proposal
from chatloom.engine.spec_decode.rejection import accept_sampled, exact_rule, residual

PROMPT = [17, 99, 4, 250, 33, 71, 8, 140]
TEMPERATURE = 0.2
N = 2000


class FixedProposer:
    """Always proposes the same two tokens: the likeliest second token, then any token."""

    costly = False

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, seqs, max_lengths):
        return [Proposal(self.tokens[:k]) for k in max_lengths]

    def verified(self, seq):
        pass

    def forget(self, seq):
        pass


class TargetGreedyProposer:
    """Proposes the target's own greedy continuation: often right at a low temperature."""

    costly = False

    def __init__(self, model) -> None:
        self.model = model

    def propose(self, seqs, max_lengths):
        out = []
        for seq, k in zip(seqs, max_lengths):
            tokens = list(seq.token_ids)
            for _ in range(k):
                tokens.append(int(self.model.dense_logits([tokens])[0][-1].argmax()))
            out.append(Proposal(tokens[len(seq.token_ids):]))
        return out

    def verified(self, seq):
        pass

    def forget(self, seq):
        pass


def wrong_rule(p, q, token, gen):
    """Plausible-looking but wrong: keep with probability p(d), else draw again from p
    (not from the residual), which favours the proposal."""
    u = float(torch.rand(1, generator=gen, dtype=torch.float64))
    if u < float(p[token]):
        return True, token
    return False, draw_token(p, gen)


def second_token_distribution(model) -> torch.Tensor:
    """The target's exact distribution of the second answer token, summed over the first."""
    m = model.model
    first = (m.dense_logits([PROMPT])[0][-1].double() / TEMPERATURE).softmax(-1)
    vocab = first.shape[0]
    rows = m.dense_logits([PROMPT + [t] for t in range(vocab)])
    second = torch.stack([(r[-1].double() / TEMPERATURE).softmax(-1) for r in rows])
    return first @ second


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Bins with an expected count of at least 5, the rest pooled."""
    expected = expected_probs * observed.sum()
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if bool((~big).any()):
        obs = torch.cat([obs, observed[~big].sum().unsqueeze(0)])
        exp = torch.cat([exp, expected[~big].sum().unsqueeze(0)])
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_second_tokens(model, rule) -> tuple[torch.Tensor, LLMEngine]:
    engine = LLMEngine(model, EngineConfig(num_blocks=2048, block_size=16, max_num_seqs=128,
                                           max_num_batched_tokens=4096, speculative="ngram",
                                           speculative_adaptive=False))
    expected = second_token_distribution(model)
    engine.spec.proposer = FixedProposer([int(expected.argmax()), 5])
    engine.spec.rule = rule
    params = [SamplingParams(max_tokens=3, temperature=TEMPERATURE, top_p=1.0, seed=i, ignore_eos=True) for i in range(N)]
    outs = engine.generate([PROMPT] * N, params, use_tqdm=False)
    counts = torch.zeros(expected.shape[0], dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[1]] += 1
    return counts, engine


@pytest.fixture(scope="module")
def expected(tiny_model):
    return second_token_distribution(tiny_model)


def test_sampled_speculation_keeps_the_target_distribution(tiny_model, expected):
    counts, engine = sample_second_tokens(tiny_model, exact_rule)
    stats = engine.get_stats()
    assert stats["spec_decode_num_drafts"] >= N  # every answer's second token went through the rule
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert float(expected.max()) > 0.1, "the proposed token should carry real mass for the test to bite"
    assert chi_square_p_value(counts, expected) > 1e-3


def test_chi_square_catches_a_wrong_acceptance_rule(tiny_model, expected):
    counts, _ = sample_second_tokens(tiny_model, wrong_rule)
    assert chi_square_p_value(counts, expected) < 1e-6


def test_draft_distribution_rule_matches_the_target():
    """With a proposer that samples from its own q, min(1, p/q) plus the residual gives p;
    resampling from p instead does not."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1], dtype=torch.float64)
    q = torch.tensor([0.3, 0.1, 0.4, 0.1, 0.1], dtype=torch.float64)

    def draws(rule) -> torch.Tensor:
        counts = torch.zeros(5, dtype=torch.float64)
        for _ in range(6000):
            d = draw_token(q, gen)
            counts[accept_sampled(torch.stack([p, p]), [d], q.unsqueeze(0), gen, rule)[0]] += 1
        return counts

    def resample_from_p(pr, qr, token, g):
        if float(torch.rand(1, generator=g, dtype=torch.float64)) * float(qr[token]) < float(pr[token]):
            return True, token
        return False, draw_token(pr, g)

    assert chi_square_p_value(draws(exact_rule), p) > 1e-3
    assert chi_square_p_value(draws(resample_from_p), p) < 1e-6
    assert torch.allclose(residual(p, q, 1), torch.tensor([0, 0.6, 0, 0.1, 0], dtype=torch.float64) / 0.7)


def test_seeded_sampling_is_the_same_with_and_without_speculation(tiny_model):
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [200, 5, 200, 5, 200]]
    params = [SamplingParams(max_tokens=24, temperature=0.3, top_p=0.95, seed=40 + i, ignore_eos=True)
              for i in range(len(prompts))]
    plain = LLMEngine(tiny_model, EngineConfig(num_blocks=256)).generate(prompts, params, use_tqdm=False)
    for adaptive in (False, True):
        engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256, speculative="ngram",
                                                    speculative_adaptive=adaptive))
        engine.spec.proposer = TargetGreedyProposer(tiny_model.model)  # often, not always, right
        got = engine.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in plain]
        if not adaptive:
            stats = engine.get_stats()
            assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
