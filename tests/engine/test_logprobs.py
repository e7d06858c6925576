"""Log probabilities (SamplingParams.logprobs, prompt_logprobs): the model's own distribution for every
token, whatever the sampling settings, computed only for the requests that ask."""
from __future__ import annotations

import math
import random

import pytest
import torch

from chatloom.engine import EngineConfig, InvalidRequest, LLMEngine, SamplingParams
from chatloom.engine.scheduler import ScheduledBatch


def _prompt(vocab: int, length: int, seed: int = 11) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def _reference(model, tokens: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position, with no cache: row p predicts token p + 1."""
    return model.dense_logits([tokens])[0].double().log_softmax(dim=-1)


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    """The request's outputs in order."""
    engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.3, top_k=5, top_p=0.8, seed=4)],
                         ids=["greedy", "sampled"])
def test_token_logprobs_are_the_models_distribution(tiny_model, sampling):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128, block_size=16))
    prompt = _prompt(tiny_model.config.vocab_size, 19)
    outs = _run(engine, prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5, **sampling))
    entries = [e for o in outs for e in o.logprobs]
    tokens = outs[-1].token_ids
    assert [e.token_id for e in entries] == tokens and len(tokens) == 8
    ref = _reference(tiny_model.model, prompt + tokens)
    for i, e in enumerate(entries):
        row = ref[len(prompt) - 1 + i]
        assert e.logprob == pytest.approx(float(row[e.token_id]), abs=1e-4)
        assert len(e.top) == 5
        assert [t for t, _ in e.top] == row.topk(5).indices.tolist()
        assert all(a[1] >= b[1] for a, b in zip(e.top, e.top[1:]))
        assert sum(math.exp(lp) for _, lp in e.top) <= 1 + 1e-6
        if sampling["temperature"] == 0:
            assert e.top[0][0] == e.token_id  # greedy: the top entry is the token drawn


def test_logprobs_zero_gives_the_tokens_own_only(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64))
    outs = _run(engine, _prompt(tiny_model.config.vocab_size, 7), SamplingParams(max_tokens=3, logprobs=0,
                                                                                  ignore_eos=True))
    entries = [e for o in outs for e in o.logprobs]
    assert len(entries) == 3 and all(e.top == () and e.logprob <= 0 for e in entries)


def test_the_end_token_has_no_entry(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64))
    prompt = _prompt(tiny_model.config.vocab_size, 9)
    free = _run(engine, prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[-1].token_ids
    outs = _run(engine, prompt, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[free[3]], logprobs=1))
    assert outs[-1].finish_reason == "stop" and outs[-1].token_ids == free[:4]
    assert [e.token_id for o in outs for e in o.logprobs] == free[:3]


@pytest.mark.parametrize("budget", [512, 7], ids=["whole", "chunked"])
def test_prompt_logprobs_cover_every_prompt_token_even_when_cached(tiny_model, budget):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128, block_size=4, max_num_batched_tokens=budget))
    prompt = _prompt(tiny_model.config.vocab_size, 23)
    _run(engine, prompt, SamplingParams(max_tokens=2))  # the prompt's blocks are in the prefix cache now
    outs = _run(engine, prompt, SamplingParams(max_tokens=2, prompt_logprobs=2, temperature=0))
    found = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert len(found) == len(prompt) and found[0] is None
    ref = _reference(tiny_model.model, prompt)
    for p in range(1, len(prompt)):
        assert found[p].token_id == prompt[p]
        assert found[p].logprob == pytest.approx(float(ref[p - 1][prompt[p]]), abs=1e-4)
        assert [t for t, _ in found[p].top] == ref[p - 1].topk(2).indices.tolist()
    assert outs[-1].logprobs is None  # not asked for the answer


def test_only_asking_requests_pay(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128, block_size=16))
    vocab = tiny_model.config.vocab_size
    plain = [_prompt(vocab, 12, seed=s) for s in range(3)]
    alone = engine.generate(plain, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for p in plain]
    asking = engine.add_request(plain[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    finals = {o.request_id: o for o in outs if o.finished}
    assert [finals[i].token_ids for i in ids] == [o.token_ids for o in alone]
    assert all(o.logprobs is None for o in outs if o.request_id != asking)
    assert [e.token_id for o in outs if o.request_id == asking for e in o.logprobs] == alone[0].token_ids
    # A decode step of greedy requests that do not ask reads only each row's argmax (the fast head);
    # one request that asks needs the step's logits.
    engine.add_request(plain[1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()
    greedy = ScheduledBatch(decodes=list(engine.scheduler.running))
    assert engine.runner._argmax_only(greedy)
    engine.add_request(plain[2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0))
    engine.step()
    assert not engine.runner._argmax_only(ScheduledBatch(decodes=list(engine.scheduler.running)))


def test_requests_for_logprobs_never_speculate(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128, speculative="ngram", num_speculative_tokens=3))
    prompt = [5, 6, 7, 8] * 6  # repetitive: the n-gram proposer has plenty to propose
    outs = _run(engine, prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1))
    assert [e.token_id for o in outs for e in o.logprobs] == outs[-1].token_ids
    assert engine.spec.stats.num_drafts == 0


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_than_twenty_alternatives_are_refused(field):
    with pytest.raises(InvalidRequest, match=f"{field} must be between 0 and 20"):
        SamplingParams(**{field: 21})
