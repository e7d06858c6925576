"""One request's bad values or failure never reach the other requests in its batch.

Each test runs a bad request in the same steps as bystanders and checks that the bystanders'
tokens are exactly what they produce alone, while the bad request is either served safely
(degenerate sampling values behave as greedy) or ends alone with finish_reason 'error'."""
from __future__ import annotations

import asyncio
import random

import pytest

from chatloom.engine import EngineConfig, InvalidRequest, LLMEngine, SamplingParams
from chatloom.engine.async_engine import AsyncEngine, RequestFailedError
from chatloom.engine.sampling_params import SEED_MAX, SEED_MIN

BAD_SAMPLING = [dict(temperature=1e-40), dict(temperature=1e-320), dict(temperature=5e-324),
                dict(temperature=1e-6), dict(top_p=1e-320), dict(top_p=1e-40), dict(top_p=5e-324),
                dict(temperature=1e-40, top_p=1e-320, top_k=3), dict(temperature=2.0, top_p=1e-300)]


def _prompts(vocab: int, n: int, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(5, 30))] for _ in range(n)]


def _bystander_params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_model):
    prompts = _prompts(tiny_model.config.vocab_size, 5)
    alone = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    solo = [alone.generate([p], _bystander_params(i), use_tqdm=False)[0].token_ids
            for i, p in enumerate(prompts[1:])]
    greedy = alone.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    return prompts, solo, greedy


@pytest.mark.parametrize("bad", BAD_SAMPLING, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_degenerate_sampling_values_are_greedy_and_harm_nobody(tiny_model, setup, bad):
    prompts, solo, greedy = setup
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    params = [SamplingParams(max_tokens=12, ignore_eos=True, seed=5, **bad)] + \
        [_bystander_params(i) for i in range(4)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length"] * 5
    assert [o.token_ids for o in outs[1:]] == solo
    if bad.get("temperature", 1.0) < 1e-5 or bad.get("top_p", 1.0) < 1e-6:
        assert outs[0].token_ids == greedy


def test_a_row_that_cannot_be_sampled_fails_alone(tiny_model, setup):
    prompts, solo, _ = setup
    vocab = tiny_model.config.vocab_size
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    # Every token banned until min_tokens: no token can be drawn for this row.
    impossible = SamplingParams(max_tokens=12, min_tokens=3, temperature=1.0, stop_token_ids=list(range(vocab)))
    outs = engine.generate(prompts, [impossible] + [_bystander_params(i) for i in range(4)], use_tqdm=False)
    assert outs[0].finish_reason == "error" and "sampling failed" in outs[0].error
    assert [o.token_ids for o in outs[1:]] == solo
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert engine.get_stats()["failed_requests"] == 1


class _PoisonedModel:
    """Wraps the model so any forward that contains `poison` raises, as a kernel bug on one input would."""

    def __init__(self, model, poison: int) -> None:
        self.model, self.poison, self.calls = model, poison, 0

    def __call__(self, ids, *args, **kwargs):
        self.calls += 1
        if bool((ids == self.poison).any()):
            raise RuntimeError("kernel fault")
        return self.model(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_failing_forward_is_retried_without_the_suspect(tiny_model, setup):
    prompts, solo, _ = setup
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    poison = max(max(p) for p in prompts) + 1
    assert poison < tiny_model.config.vocab_size
    engine.runner.model = _PoisonedModel(tiny_model.model, poison)
    outs = engine.generate([prompts[0] + [poison]] + prompts[1:],
                           [SamplingParams(max_tokens=12, ignore_eos=True)] + [_bystander_params(i) for i in range(4)],
                           use_tqdm=False)
    assert outs[0].finish_reason == "error" and "kernel fault" in outs[0].error
    assert [o.finish_reason for o in outs[1:]] == ["length"] * 4
    assert [o.token_ids for o in outs[1:]] == solo
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


@pytest.mark.parametrize("seed", [2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30])
def test_seeds_outside_signed_64_bit_are_refused(seed):
    with pytest.raises(InvalidRequest, match="signed 64-bit"):
        SamplingParams(seed=seed)


def test_seed_range_edges_are_accepted(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64))
    p = _prompts(tiny_model.config.vocab_size, 1)[0]
    for seed in (SEED_MIN, SEED_MAX, -1):
        out = engine.generate([p], SamplingParams(max_tokens=3, temperature=1.0, seed=seed), use_tqdm=False)[0]
        assert out.finish_reason in ("length", "stop")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_sampling_values_are_refused(value):
    with pytest.raises(InvalidRequest):
        SamplingParams(temperature=value)
    with pytest.raises(InvalidRequest):
        SamplingParams(top_p=value)


async def test_async_bystander_streams_survive_a_failing_request(tiny_model, setup):
    prompts, solo, _ = setup
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    poison = max(max(p) for p in prompts) + 1
    engine.runner.model = _PoisonedModel(tiny_model.model, poison)
    aeng = AsyncEngine(engine)
    try:
        async def run(prompt, params):
            async for out in aeng.stream(prompt, params):
                if out.finished:
                    return out.token_ids

        tasks = [run(prompts[0] + [poison], SamplingParams(max_tokens=12, ignore_eos=True))]
        tasks += [run(p, _bystander_params(i)) for i, p in enumerate(prompts[1:])]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[0], RequestFailedError) and "kernel fault" in str(results[0])
        assert results[1:] == solo
    finally:
        aeng.shutdown()


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("given_argmax", [True, False])
def test_a_row_with_nan_logits_fails_alone(greedy, given_argmax):
    """One NaN anywhere in a row (not only at its largest logit) fails that row, and only that row,
    whether the runner's argmax comes with the logits or the sampler computes it."""
    import torch

    from chatloom.engine.sampler import Sampler
    from chatloom.engine.sequence import Sequence

    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 777] = float("nan")
    logits[3, 0] = float("nan")
    params = SamplingParams(max_tokens=4, temperature=0.0 if greedy else 0.8, seed=1)
    seqs = [Sequence(f"r{i}", [1, 2, 3], params) for i in range(4)]
    argmax = logits.argmax(dim=-1) if given_argmax else None
    tokens, failures = Sampler(seed=0).sample(logits, seqs, [0], argmax)
    assert set(failures) == {1, 3} and "NaN" in str(failures[1])
    assert tokens[1] is None and tokens[3] is None
    assert all(0 <= t < 1000 for i, t in enumerate(tokens) if i in (0, 2))


@pytest.mark.parametrize("min_tokens", [0, 2])
def test_greedy_picks_from_the_forward_give_the_same_tokens(min_tokens):
    """The native decode step's argmax as ints (GreedyPicks) stands in for the tensor, NaN rows
    included; a row whose stop tokens are still banned (min_tokens) is ranked again, not picked."""
    import torch

    from chatloom.engine.sampler import GreedyPicks, Sampler
    from chatloom.engine.sequence import Sequence

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    logits[0, 7] = 9.0  # row 0's maximum is the end-of-sequence token 7
    logits[2, 3] = float("nan")
    params = SamplingParams(max_tokens=4, temperature=0.0, min_tokens=min_tokens)
    seqs = [Sequence(f"g{i}", [1, 2, 3], params) for i in range(3)]
    argmax = logits.argmax(dim=-1)
    picks = GreedyPicks(argmax.tolist(), [2])
    expected = Sampler(seed=0).sample(logits.clone(), seqs, [7], argmax)
    tokens, failures = Sampler(seed=0).sample(logits.clone(), seqs, [7], argmax, picks)
    assert tokens == expected[0] and set(failures) == set(expected[1]) == {2}
    assert (tokens[0] == 7) == (min_tokens == 0)


def test_stop_tokens_are_banned_in_logits_a_forward_made_in_inference_mode():
    """The forward runs under torch.inference_mode, whose tensors refuse the in-place ban outside it:
    min_tokens must still hold (it once failed the request on replicas running without the C++ kernels)."""
    import torch

    from chatloom.engine.sampler import Sampler
    from chatloom.engine.sequence import Sequence

    with torch.inference_mode():
        logits = torch.zeros(2, 20)
        logits[:, 7] = 5.0  # the end-of-sequence token leads every row
    seqs = [Sequence("held", [1, 2], SamplingParams(max_tokens=4, temperature=0.0, min_tokens=2)),
            Sequence("free", [1, 2], SamplingParams(max_tokens=4, temperature=0.0))]
    tokens, failures = Sampler(seed=0).sample(logits, seqs, [7])
    assert failures == {} and tokens[0] != 7 and tokens[1] == 7
