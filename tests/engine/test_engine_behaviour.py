"""Sampling, stopping, aborting and streaming behaviour of the engine."""
from __future__ import annotations

import asyncio
import random

import pytest

from chatloom.engine import EngineConfig, InvalidRequest, LLMEngine, SamplingParams
from chatloom.engine.async_engine import AsyncEngine
from chatloom.engine.detokenizer import IncrementalDetokenizer


def _prompts(vocab: int, n: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_model):
    vocab = tiny_model.config.vocab_size
    target = _prompts(vocab, 1, seed=99)[0]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)

    alone = LLMEngine(tiny_model, EngineConfig(num_blocks=512, block_size=16))
    solo = alone.generate([target], params, use_tqdm=False)[0].token_ids

    crowded = LLMEngine(tiny_model, EngineConfig(num_blocks=512, block_size=16, max_num_batched_tokens=17))
    others = _prompts(vocab, 9)
    mixed = [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)] * 9
    outs = crowded.generate(others[:4] + [target] + others[4:], mixed[:4] + [params] + mixed[4:], use_tqdm=False)
    assert outs[4].token_ids == solo
    # A different seed gives a different text (the seed really drives the draw).
    other = alone.generate([target], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50,
                                                    seed=4321, ignore_eos=True), use_tqdm=False)[0]
    assert other.token_ids != solo


def test_top_k_one_is_greedy(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    p = _prompts(tiny_model.config.vocab_size, 1)[0]
    greedy = engine.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    topk1 = engine.generate([p], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True),
                            use_tqdm=False)
    assert greedy[0].token_ids == topk1[0].token_ids


def test_abort_mid_generation_frees_every_block(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128, block_size=4, enable_prefix_caching=False))
    ids = [engine.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True))
           for p in _prompts(tiny_model.config.vocab_size, 4)]
    for _ in range(5):
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks < 128
    for rid in ids:
        assert engine.abort(rid)
    assert engine.kv_cache_manager.num_free_blocks == 128
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == sorted(ids)
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()


def test_finish_reasons_and_token_limits(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    eos = tiny_model.tokenizer.eos_token_ids[0]
    p = _prompts(tiny_model.config.vocab_size, 1)[0]
    out = engine.generate([p], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert (out.finish_reason, out.num_output_tokens) == ("length", 7)
    # Treat the first greedy token as a stop token: generation ends at once with 'stop'.
    first = out.token_ids[0]
    stopped = engine.generate([p], SamplingParams(max_tokens=7, temperature=0, stop_token_ids=[first]),
                              use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and stopped.num_output_tokens == 1
    assert stopped.stop_str is None  # a stop token, not a stop string
    # min_tokens forbids stop tokens until reached.
    held = engine.generate([p], SamplingParams(max_tokens=7, min_tokens=3, temperature=0,
                                               stop_token_ids=[first, eos]), use_tqdm=False)[0]
    assert held.num_output_tokens >= 3 and first not in held.token_ids[:3]


def test_stop_string_ends_generation_and_is_not_emitted(smollm2):
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=256))
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    full = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    stop = full.text.strip().split(",")[1].strip()  # some number the model will write
    assert stop
    streamed = ""
    engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, stop=["never written", stop]), "s")
    final = None
    while final is None:
        for out in engine.step():
            streamed += out.delta_text
            if out.finished:
                final = out
    assert final.finish_reason == "stop" and final.stop_str == stop  # which stop string ended it
    assert stop not in final.text and stop not in streamed
    assert streamed == final.text


def test_detokenizer_holds_back_split_multibyte_characters(smollm2):
    tok = smollm2.tokenizer
    text = "naïve café 東京 🙂 done"
    ids = tok.encode(text, add_special=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)


def test_bad_requests_are_rejected(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=8, block_size=16, max_model_len=100))
    with pytest.raises(InvalidRequest, match="context window"):
        engine.add_request(list(range(100)), SamplingParams(max_tokens=5))
    small_pool = LLMEngine(tiny_model, EngineConfig(num_blocks=8, block_size=16, max_model_len=1000))
    with pytest.raises(InvalidRequest, match="KV cache"):
        small_pool.add_request(list(range(50)), SamplingParams(max_tokens=90))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequest):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequest):
        SamplingParams(top_p=1.5)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), "dup")
    with pytest.raises(InvalidRequest, match="in use"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), "dup")


def test_priority_orders_admission_and_preemption_picks_the_lowest(tiny_model):
    # Room for two sequences only: the high-priority request must be served first.
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=6, block_size=8, max_num_seqs=8))
    prompts = _prompts(tiny_model.config.vocab_size, 3, seed=5)
    engine.add_request(prompts[0][:8], SamplingParams(max_tokens=14, ignore_eos=True), "low", priority=5)
    engine.add_request(prompts[1][:8], SamplingParams(max_tokens=14, ignore_eos=True), "mid", priority=3)
    engine.step()
    engine.add_request(prompts[2][:8], SamplingParams(max_tokens=14, ignore_eos=True), "high", priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished.index("high") < finished.index("low")
    assert engine.scheduler.num_preemptions >= 1


def test_background_sequences_sit_out_steps_that_read_a_foreground_prompt(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=8,
                                                max_num_batched_tokens=16, background_priority=1000,
                                                background_yield="prefill"))
    prompts = _prompts(tiny_model.config.vocab_size, 3, seed=7)
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    engine.add_request(prompts[0][:8], params, "batch-a", priority=1000)
    engine.add_request(prompts[1][:8], params, "batch-b", priority=1000)
    engine.step()  # both batch prompts read: no foreground work yet, so they run
    engine.step()
    assert {s.request_id for s in engine.scheduler.running} == {"batch-a", "batch-b"}
    decoded = {s.request_id: s.num_computed_tokens for s in engine.scheduler.running}
    # A 30-odd-token interactive prompt takes several steps of at most 16 tokens; the batch decodes in none.
    engine.add_request(prompts[2][:40], params, "chat", priority=0)
    chat, steps = engine.scheduler.waiting[0], 0
    while chat.num_computed_tokens < chat.prompt_len:
        engine.step()
        steps += 1
        assert {s.request_id: s.num_computed_tokens for s in engine.scheduler.running
                if s.request_id.startswith("batch")} == decoded
    assert steps >= 2
    engine.step()  # a decode-only step carries the batch again
    assert all(s.num_computed_tokens == decoded[s.request_id] + 1 for s in engine.scheduler.running
               if s.request_id.startswith("batch"))


def _batch_running(tiny_model, background_yield: str, seed: int) -> tuple[LLMEngine, list[list[int]]]:
    """An engine whose batch request (priority 1000, the background floor) has run two steps, and the prompts
    (the second for a foreground request)."""
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=8,
                                                max_num_batched_tokens=16, background_priority=1000,
                                                background_yield=background_yield))
    prompts = _prompts(tiny_model.config.vocab_size, 2, seed=seed)
    engine.add_request(prompts[0][:8], SamplingParams(max_tokens=30, ignore_eos=True), "batch", priority=1000)
    engine.step()
    engine.step()
    return engine, prompts


def test_background_sequences_use_only_idle_steps_where_steps_cost_per_sequence(tiny_model):
    engine, prompts = _batch_running(tiny_model, "auto", seed=9)
    assert engine.scheduler.config.background_yield == "step"  # a CPU
    batch = engine.scheduler.running[0]
    before = batch.num_computed_tokens
    engine.add_request(prompts[1][:8], SamplingParams(max_tokens=5, ignore_eos=True), "chat", priority=0)
    while any(s.request_id == "chat" for s in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()  # the chat's prompt and every one of its decodes
        assert batch.num_computed_tokens == before
    engine.step()  # idle again: the batch goes on
    assert batch.num_computed_tokens == before + 1


def test_step_seconds_count_each_step_by_what_it_carried(tiny_model):
    engine, prompts = _batch_running(tiny_model, "step", seed=9)
    first = engine.snapshot().step_seconds
    assert first["background"] > 0 and first["foreground"] == 0 and first["interrupted"] == 0
    engine.add_request(prompts[1][:8], SamplingParams(max_tokens=5, ignore_eos=True), "chat", priority=0)
    while any(s.request_id == "chat" for s in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()  # steps with the chat in them (the batch sits them out)
    second = engine.snapshot().step_seconds
    assert second["foreground"] > 0 and second["background"] == first["background"]
    assert engine.get_stats()["foreground_step_seconds"] == second["foreground"]


def test_a_step_of_background_sequences_alone_is_short(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=8,
                                                max_num_batched_tokens=64, background_priority=1000,
                                                background_step_tokens=8))
    prompts = _prompts(tiny_model.config.vocab_size, 3, seed=11)
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    engine.add_request(prompts[0][:20], params, "batch-a", priority=1000)
    engine.add_request(prompts[1][:20], params, "batch-b", priority=1000)
    computed = []
    for _ in range(3):  # only batch work queued: 8 tokens a step, not the 40 the budget would take
        engine.step()
        computed.append(sum(s.num_computed_tokens for s in engine.scheduler.running))
    assert computed == [8, 16, 24]
    # Foreground work queued: the whole budget, most of its 30-token prompt read in one step.
    engine.add_request(prompts[2][:30], params, "chat", priority=0)
    engine.step()
    chat = next(s for s in engine.scheduler.running if s.request_id == "chat")
    assert chat.num_computed_tokens >= 24


def test_without_a_background_floor_every_sequence_runs_in_every_step(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=8,
                                                max_num_batched_tokens=16, background_priority=None))
    prompts = _prompts(tiny_model.config.vocab_size, 2, seed=7)
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    engine.add_request(prompts[0][:8], params, "batch", priority=1000)
    engine.step()
    engine.step()
    before = engine.scheduler.running[0].num_computed_tokens
    engine.add_request(prompts[1][:40], params, "chat", priority=0)
    engine.step()
    batch = next(s for s in engine.scheduler.running if s.request_id == "batch")
    assert batch.num_computed_tokens == before + 1


def test_held_background_sequences_sit_out_every_step_until_let_go(tiny_model):
    # "prefill": unheld, batch decodes ride along with a foreground decode; held, they sit out even those.
    engine, prompts = _batch_running(tiny_model, "prefill", seed=13)
    batch = engine.scheduler.running[0]
    before = batch.num_computed_tokens
    engine.hold_background(True)
    assert engine.only_held_work()  # nothing else queued: a step would run nothing
    assert engine.step() == [] and batch.num_computed_tokens == before
    engine.add_request(prompts[1][:8], SamplingParams(max_tokens=4, ignore_eos=True), "chat", priority=0)
    assert not engine.only_held_work()
    while any(s.request_id == "chat" for s in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()  # the chat's prompt and its decodes, the batch in none of them
        assert batch.num_computed_tokens == before
    engine.hold_background(False)
    assert not engine.only_held_work()
    engine.step()
    assert batch.num_computed_tokens == before + 1


async def test_async_engine_idles_while_only_held_background_work_is_queued(tiny_model_fp32):
    engine = AsyncEngine.from_model(tiny_model_fp32, EngineConfig(num_blocks=256, block_size=4,
                                                                  background_priority=1000))
    steps = []
    step = engine.engine.step
    engine.engine.step = lambda: steps.append(1) or step()
    try:
        engine.hold_background(True)
        batch = asyncio.create_task(engine.generate("a batch line", SamplingParams(max_tokens=8, ignore_eos=True),
                                                    priority=1000))
        # The batch request reaches the engine and sits there: no step runs it while held.
        sched = engine.engine.scheduler
        for _ in range(500):
            if sched.background_held and sched.running + sched.waiting:
                break
            await asyncio.sleep(0.01)
        queued = (sched.running + sched.waiting)[0]
        chat = await asyncio.wait_for(engine.generate("hi", SamplingParams(max_tokens=4, ignore_eos=True)), 30)
        assert chat.num_output_tokens == 4 and not batch.done()
        assert queued.priority == 1000 and queued.num_computed_tokens == 0
        assert len(steps) < 50  # the chat's few steps: no spinning over the held batch line meanwhile
        engine.hold_background(False)
        out = await asyncio.wait_for(batch, 30)
        assert out.finished and out.num_output_tokens == 8
    finally:
        engine.shutdown()


async def test_async_engine_streams_and_cancelling_aborts(tiny_model_fp32):
    engine = AsyncEngine.from_model(tiny_model_fp32, EngineConfig(num_blocks=256, block_size=4))
    try:
        text, last = "", None
        async for out in engine.stream("hello there", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)):
            text += out.delta_text
            last = out
        assert last.finished and last.num_output_tokens == 12 and text == last.text

        async def consume():
            async for _ in engine.stream("a long one", SamplingParams(max_tokens=100000 // 1000, ignore_eos=True)):
                await asyncio.sleep(0.01)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            stats = engine.get_stats()
            if stats["num_requests_running"] == 0 and stats["kv_cache_usage_perc"] == 0:
                break
            await asyncio.sleep(0.02)
        assert stats["num_requests_running"] == 0 and stats["kv_cache_usage_perc"] == 0
    finally:
        engine.shutdown()


async def test_async_engine_hands_outputs_over_as_the_next_forward_starts(tiny_model_fp32):
    """A step's outputs reach the event loop just before the next step's forward (after its Python,
    which the woken event loop would otherwise hold up at every GIL hand-off), and the last ones at
    once, with no step to wait for."""
    engine = AsyncEngine.from_model(tiny_model_fp32, EngineConfig(num_blocks=256, block_size=4))
    try:
        runner, events = engine.engine.runner, []
        hand_over, prepare = runner.before_forward, runner._prepare
        runner.before_forward = lambda: events.append(("hand_over", len(engine._pending))) or hand_over()
        runner._prepare = lambda batch: events.append(("prepare", 0)) or prepare(batch)
        outs = [out async for out in engine.stream("hello there", SamplingParams(max_tokens=12, temperature=0,
                                                                                  ignore_eos=True))]
        assert len(outs) == 12 and outs[-1].finished and not engine._pending
        assert [e for e, _ in events] == ["prepare", "hand_over"] * 12  # each forward after its step's Python
        # The prefill had nothing to hand over; each decode step's forward handed over one output; the last
        # went at once.
        assert [n for e, n in events if e == "hand_over"] == [0] + [1] * 11
    finally:
        engine.shutdown()


async def test_a_failed_step_fails_its_requests_but_not_the_engine(tiny_model_fp32):
    engine = AsyncEngine.from_model(tiny_model_fp32, EngineConfig(num_blocks=64))
    try:
        real_execute = engine.engine.runner.execute
        calls = {"n": 0}

        def flaky(batch):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("simulated kernel failure")
            return real_execute(batch)

        engine.engine.runner.execute = flaky
        from chatloom.engine.async_engine import EngineDeadError
        with pytest.raises(EngineDeadError, match="simulated"):
            async for _ in engine.stream("doomed", SamplingParams(max_tokens=20, ignore_eos=True)):
                pass
        assert engine.get_stats()["kv_cache_usage_perc"] == 0
        out = await engine.generate("still alive", SamplingParams(max_tokens=5, ignore_eos=True))
        assert out.finished and out.num_output_tokens == 5
    finally:
        engine.shutdown()
