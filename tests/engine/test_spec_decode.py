"""Speculative decoding must not change what greedy decoding produces: the same tokens
with and without it, whatever the batch, chunking, preemption or prefix-cache hits, and
the KV pool must end where it started. Stops inside an accepted run end the answer at
the same token as without speculation."""
from __future__ import annotations

import random

import pytest
import torch

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.spec_decode.decoder import SpeculativeDecoder
from chatloom.engine.spec_decode.proposer import NgramProposer
from chatloom.engine.spec_decode.rejection import accept_greedy
from chatloom.engine.sequence import Sequence


def repeating_prompts(vocab: int, n: int, seed: int = 5) -> list[list[int]]:
    """Prompts that repeat pieces of themselves, so prompt lookup finds matches (the tiny
    random model also tends to loop, which gives the proposer its own output to reuse)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts = []
    for i in range(n):
        piece = [rng.randrange(vocab) for _ in range(rng.randrange(3, 12))]
        body = piece * rng.randrange(2, 5) + [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        prompts.append((shared[:rng.randrange(17, 40)] if i % 3 == 0 else []) + body)
    return prompts


def run(model, prompts, spec: str, n: int = 24, **config) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(model, EngineConfig(speculative=spec, **config))
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(o.finish_reason == "length" and len(o.token_ids) == n for o in outs)
    return [o.token_ids for o in outs], engine


CONFIGS = {
    "roomy": dict(num_blocks=256, block_size=16),
    # Small blocks and a small budget: chunked prefills share steps with proposals.
    "chunked": dict(num_blocks=256, block_size=4, max_num_batched_tokens=29),
    # A pool too small for everyone: preemption by recompute while proposals are in flight.
    "tight-pool": dict(num_blocks=24, block_size=8, max_num_seqs=6),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("adaptive", [False, True], ids=["always", "adaptive"])
def test_greedy_ngram_is_token_identical(tiny_model, name, adaptive):
    prompts = repeating_prompts(tiny_model.config.vocab_size, 18)
    config = CONFIGS[name]
    want, _ = run(tiny_model, prompts, "off", **config)
    got, engine = run(tiny_model, prompts, "ngram", speculative_adaptive=adaptive, num_speculative_tokens=5,
                      **config)
    assert got == want
    stats = engine.get_stats()
    if not adaptive:  # the adaptive planner may rightly judge proposals not worth it for this model
        assert stats["spec_decode_num_accepted_tokens"] > 10
        assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], \
            "some proposals should be rejected, so rollback is exercised"
    if name == "tight-pool":
        assert stats["num_preemptions"] > 0
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_count == 0 for b in kv.pool.blocks)


def test_prefix_cache_hits_after_speculation_stay_exact(tiny_model):
    """Blocks registered by a speculating sequence serve later prompts: only verified
    tokens may have been published, or the continuation would change."""
    vocab = tiny_model.config.vocab_size
    prompts = repeating_prompts(vocab, 6, seed=11)
    config = dict(num_blocks=128, block_size=4, speculative_adaptive=False)
    engine = LLMEngine(tiny_model, EngineConfig(speculative="ngram", **config))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    first = engine.generate(prompts, params, use_tqdm=False)
    # Second round: each prompt extended by part of its answer, so whole blocks of prompt
    # and speculated answer come from the prefix cache.
    follow = [p + o.token_ids[:19] for p, o in zip(prompts, first)]
    second = engine.generate(follow, params, use_tqdm=False)
    assert engine.get_stats()["prefix_cache_hits"] > 0
    plain = LLMEngine(tiny_model, EngineConfig(num_blocks=128, block_size=4, enable_prefix_caching=False))
    assert [o.token_ids for o in second] == [o.token_ids for o in plain.generate(follow, params, use_tqdm=False)]
    # Every published key names a block of verified tokens: no rejected proposal was published.
    pool = engine.kv_cache_manager.pool
    valid = set()
    for p, o in zip(prompts + follow, first + second):
        tokens, parent = p + o.token_ids, pool.root_key
        for i in range(len(tokens) // pool.block_size):
            parent = pool.block_key(parent, tuple(tokens[i * pool.block_size:(i + 1) * pool.block_size]))
            valid.add(parent)
    assert pool.cached and set(pool.cached) <= valid


def test_stops_inside_an_accepted_run(tiny_model):
    """Stop strings, stop tokens and max_tokens that fall mid-run end the answer exactly
    where decoding without speculation ends it."""
    vocab = tiny_model.config.vocab_size
    prompts = repeating_prompts(vocab, 8, seed=3)
    base = dict(num_blocks=256, block_size=4)
    plain = LLMEngine(tiny_model, EngineConfig(**base))
    spec = LLMEngine(tiny_model, EngineConfig(speculative="ngram", speculative_adaptive=False,
                                              num_speculative_tokens=6, **base))
    free = plain.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    cases = []
    for p, o in zip(prompts, free):
        ids = o.token_ids
        cases.append((p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[ids[17]])))
        cases.append((p, SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)))
        text = o.text
        if len(text) > 30:
            cases.append((p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[text[20:23]])))
        cases.append((p, SamplingParams(max_tokens=40, temperature=0, min_tokens=25, ignore_eos=False,
                                        stop_token_ids=[ids[3]])))
    want = plain.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    got = spec.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert spec.get_stats()["spec_decode_num_accepted_tokens"] > 0
    assert spec.kv_cache_manager.num_free_blocks == spec.kv_cache_manager.num_blocks


def _stream(engine: LLMEngine, prompt: list[int]) -> tuple[str, list[int], object]:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    text, tokens, final = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            text += out.delta_text
            tokens += out.delta_token_ids
            final = out
    return text, tokens, final


def test_streamed_deltas_add_up_with_several_tokens_per_step(tiny_model):
    prompt = repeating_prompts(tiny_model.config.vocab_size, 1, seed=9)[0]
    spec = LLMEngine(tiny_model, EngineConfig(num_blocks=128, speculative="ngram", speculative_adaptive=False))
    text, tokens, final = _stream(spec, prompt)
    assert final.finished and text == final.text
    assert spec.get_stats()["spec_decode_num_accepted_tokens"] > 0
    # The same deltas, joined, as one token per step gives.
    assert (text, tokens) == _stream(LLMEngine(tiny_model, EngineConfig(num_blocks=128)), prompt)[:2]


def test_ngram_proposer_continues_the_latest_longest_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    seq = Sequence("a", [5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], SamplingParams())
    # The suffix [1, 2, 3] last occurred before [7, 8, ...].
    assert proposer.propose([seq], [4])[0].tokens == [7, 8, 1, 2]
    seq.token_ids += [7, 4]
    # No 2- or 3-gram match for [..., 7, 4]; the 1-gram 4 never occurred before.
    assert proposer.propose([seq], [3])[0].tokens == []
    seq.token_ids += [8]
    assert proposer.propose([seq], [2])[0].tokens == [1, 2]  # 1-gram 8 -> what followed it
    assert proposer.propose([seq], [0])[0].tokens == []


def test_greedy_acceptance_rule():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all kept, plus the bonus
    assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # first mismatch: the target's token
    assert accept_greedy([1, 2], [3]) == [1]


def test_real_model_greedy_identical_with_ngram(smollm2):
    """SmolLM2 (fp32): checking several tokens in one forward may round differently from
    one at a time, so a divergence is allowed only at a near tie of the plain run's logits."""
    tok = smollm2.tokenizer
    text = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
            "Repeat that sentence exactly.")
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    prompts = [tok.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n") for t in
               (text, "Fix the bug in this code and print it again:\n" + code)]
    n = 32
    want, _ = run(smollm2, prompts, "off", n, num_blocks=64)
    got, engine = run(smollm2, prompts, "ngram", n, num_blocks=64, speculative_adaptive=False)
    assert engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    full = smollm2.model.dense_logits([p + w for p, w in zip(prompts, want)])
    for p, w, g, logits in zip(prompts, want, got, full):
        for i, (a, b) in enumerate(zip(w, g)):
            if a != b:
                row = logits[len(p) - 1 + i].double()
                assert float(row[a] - row[b]) < 1e-3, f"token {i}: {a} vs {b} is no near tie"
                break




def test_greedy_steps_find_each_rows_argmax_alone_with_ngram_on(smollm2, monkeypatch):
    """With speculation on and every request greedy, no step computes logits nobody reads: a step in
    which no sequence carries proposals takes the native step's argmax-only head, as it would with
    speculation off, and a step that checks proposals asks the stack for each row's argmax alone
    (screened where it is wider than the team). Same tokens as with speculation off.
    (The tiny model has no native head, so this needs the bundled model's quantized one.)"""
    tok = smollm2.tokenizer
    prompts = [tok.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n") for t in
               ("Say the word apple five times.", "Name three colours.", "Count from one to ten.",
                "Repeat after me: the cat sat on the mat.", "Spell the word banana.", "List the days of the week.")]
    model = smollm2.model
    if not model.decodes_tokens():
        pytest.skip("no native decode step here (kernels off)")
    plain_calls: list[bool] = []
    checking_calls: list[int] = []  # the logits' width each step checking proposals got back
    native, checking = model.decode_tokens, model.decode_argmax

    def plain_spy(*args, **kwargs):
        plain_calls.append(bool(kwargs.get("argmax_only", args[6] if len(args) > 6 else False)))
        return native(*args, **kwargs)

    def checking_spy(*args, **kwargs):
        found = checking(*args, **kwargs)
        checking_calls.append(found[0].shape[1])
        return found

    monkeypatch.setattr(model, "decode_tokens", plain_spy)
    monkeypatch.setattr(model, "decode_argmax", checking_spy)
    got, engine = run(smollm2, prompts, "ngram", 16, num_blocks=128, speculative_adaptive=False)
    stats = engine.get_stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert plain_calls and all(plain_calls), "every plain greedy decode step should skip the logits"
    assert checking_calls and 0 in checking_calls, "wide checking steps should get no logits"
    monkeypatch.undo()
    want, _ = run(smollm2, prompts, "off", 16, num_blocks=128)
    assert got == want


def test_a_checked_sequence_with_nan_logits_fails_alone():
    """verify() with the forward's picks: a sequence whose rows hold a NaN fails; the others,
    plain or with proposals, get their tokens."""
    from chatloom.engine.sampler import GreedyPicks, Sampler

    decoder = SpeculativeDecoder(NgramProposer(), 4, 1024, adaptive=False)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    seqs = [Sequence(f"s{i}", [1, 2, 3], greedy) for i in range(3)]
    seqs[0].spec_token_ids = [7, 8]  # rows 0-2
    seqs[2].spec_token_ids = [5]  # rows 4-5; row 3 is seqs[1]'s
    picks = GreedyPicks([7, 9, 4, 6, 5, 2], nan_rows=[5])
    tokens, failures = decoder.verify(torch.empty(6, 0), torch.tensor(picks.tokens), seqs, Sampler(0), [0], picks)
    assert tokens[0] == [7, 9] and tokens[1] == [6]
    assert list(failures) == [2] and "NaN" in str(failures[2])


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_checked_sequence_with_nan_logits_fails_alone_without_picks(temperature):
    """verify() from full logits (no picks: a stack without a native head, or sampled requests): a
    sequence whose checked rows hold a NaN fails; the other sequences keep their tokens."""
    from chatloom.engine.sampler import Sampler

    decoder = SpeculativeDecoder(NgramProposer(), 4, 1024, adaptive=False)
    params = SamplingParams(max_tokens=16, temperature=temperature, seed=1)
    seqs = [Sequence(f"s{i}", [1, 2, 3], params) for i in range(2)]
    for seq in seqs:
        seq.spec_token_ids = [7]
    logits = torch.full((4, 10), -5.0)
    logits[:2, 7] = 5.0  # seqs[0]: its proposal and the next token are clear winners
    logits[2, 7] = 5.0
    logits[3, 4] = float("nan")  # seqs[1]'s second row failed
    tokens, failures = decoder.verify(logits, None, seqs, Sampler(0), [0])
    assert tokens[0][0] == 7 and list(failures) == [1] and "NaN" in str(failures[1])
