"""Several choices for one prompt (SamplingParams.n): one prefill, the prompt's blocks shared by the forks
(the partial last block copied), each choice with its own random stream and finish, nothing leaked."""
from __future__ import annotations

import random

import pytest

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.async_engine import AsyncEngine


def _prompt(vocab: int, length: int, seed: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def _no_blocks_held(engine: LLMEngine) -> bool:
    kv = engine.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks and all(b.ref_count == 0 for b in kv.pool.blocks)


def test_forks_share_the_prompt_blocks_after_one_prefill(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=16))
    kv = engine.kv_cache_manager
    prompt = _prompt(tiny_model.config.vocab_size, 40)  # two full blocks and a partial one of 8
    engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3, ignore_eos=True),
                       request_id="r")
    engine.step()  # the whole prompt, and the first token of each choice
    seqs = sorted(engine.scheduler.running, key=lambda s: s.index)
    assert [s.index for s in seqs] == [0, 1, 2] and [s.group_id for s in seqs] == ["r"] * 3
    shared = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in seqs)
    assert [kv.pool.blocks[b].ref_count for b in shared] == [3, 3]
    tails = {s.block_table[2] for s in seqs}
    assert len(tails) == 3  # each choice writes its own token into its own copy of the partial block
    # One prefill: the prompt was looked up (and computed) once, not once per choice.
    assert kv.query_tokens == len(prompt) - 1
    assert kv.num_blocks - kv.num_free_blocks == 2 + 3
    assert all(s.num_computed_tokens == len(prompt) and s.num_output_tokens == 1 for s in seqs)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert all(o.request_id == "r" and len(o.token_ids) == 6 and o.finish_reason == "length" for o in finals)
    assert _no_blocks_held(engine) and not engine._groups


def test_a_prompt_of_whole_blocks_is_shared_without_a_copy(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=16))
    engine.add_request(_prompt(tiny_model.config.vocab_size, 32), SamplingParams(max_tokens=3, n=2, ignore_eos=True))
    engine.step()
    a, b = engine.scheduler.running
    assert a.block_table == b.block_table and len(a.block_table) == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert _no_blocks_held(engine)


def test_each_choice_has_its_own_random_stream(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128, block_size=16))
    prompt = _prompt(tiny_model.config.vocab_size, 21)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, n=3, ignore_eos=True)
    first = [o.token_ids for o in engine.generate([prompt], params, use_tqdm=False)]
    again = [o.token_ids for o in engine.generate([prompt], params, use_tqdm=False)]
    assert first == again  # same seed, same choices
    assert len({tuple(t) for t in first}) == 3  # and they differ from each other
    # Choice i draws as a request of its own seeded with seed + i would.
    alone = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=44, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    assert alone == first[2]


def test_choices_finish_on_their_own(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128, block_size=16))
    vocab = tiny_model.config.vocab_size
    prompt = _prompt(vocab, 10)
    # Stop tokens the choices meet at different points: each ends when it does, the others go on.
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=9, n=4, stop_token_ids=list(range(0, vocab, 5)))
    outs = engine.generate([prompt], params, use_tqdm=False)
    assert sorted(o.index for o in outs) == [0, 1, 2, 3]
    assert len({len(o.token_ids) for o in outs}) > 1
    assert _no_blocks_held(engine)


def test_abort_stops_every_choice_and_frees_their_blocks(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=4))
    engine.add_request(_prompt(tiny_model.config.vocab_size, 13), SamplingParams(max_tokens=50, n=3, ignore_eos=True),
                       request_id="a")
    for _ in range(3):
        engine.step()
    assert engine.abort("a")
    assert _no_blocks_held(engine)
    outs = engine.step()
    assert sorted((o.request_id, o.index, o.finish_reason) for o in outs) == [("a", i, "abort") for i in range(3)]
    assert not engine.has_unfinished_requests() and not engine._groups


def test_a_fork_without_a_free_block_computes_its_prompt_again(tiny_model):
    # 3 blocks of 4 hold the prompt (9 tokens: two full blocks and one partial); no block is left for a
    # fork's copy, so the forks wait, and run (prompt from the prefix cache) as blocks come free.
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=4, block_size=4, max_model_len=16))
    prompt = _prompt(tiny_model.config.vocab_size, 9)
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=3, ignore_eos=True)
    outs = engine.generate([prompt], params, use_tqdm=False)
    assert sorted(o.index for o in outs) == [0, 1, 2] and all(len(o.token_ids) == 3 for o in outs)
    roomy = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=4, max_model_len=16))
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate([prompt], params, use_tqdm=False)]
    assert _no_blocks_held(engine)


async def test_the_async_stream_ends_after_every_choice(tiny_model):
    engine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=16)))
    try:
        seen: dict[int, list[int]] = {}
        finished = []
        async for out in engine.stream(_prompt(tiny_model.config.vocab_size, 12),
                                       SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=2, ignore_eos=True)):
            seen.setdefault(out.index, []).extend(out.delta_token_ids)
            if out.finished:
                finished.append(out.index)
        assert sorted(finished) == [0, 1, 2] and sorted(seen) == [0, 1, 2]
    finally:
        engine.shutdown()
    assert _no_blocks_held(engine.engine)


@pytest.mark.parametrize("n", [0, -1])
def test_n_below_one_is_refused(n):
    from chatloom.engine import InvalidRequest
    with pytest.raises(InvalidRequest, match="n must be at least 1"):
        SamplingParams(n=n)
