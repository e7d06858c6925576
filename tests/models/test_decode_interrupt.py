"""A decode step of background (batch) work alone stops between two layers when foreground work comes
in (DecodeStack.interrupt, LLMEngine.interrupt_background), and runs again later with the same result.

A stopped step has written this step's K/V for its first layers only; run again, it writes the same
values at the same slots, so nothing of it shows."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from chatloom.engine.async_engine import AsyncEngine
from chatloom.engine.config import EngineConfig
from chatloom.engine.llm_engine import LLMEngine
from chatloom.engine.sampling_params import SamplingParams
from chatloom.models.kernels import load_kernels
from chatloom.models.loader import LoadedModel
from chatloom.models.packed_linear import pack_linears

from test_decode_stack import (CONFIG, _model, _plain_batch, _pool, _restore, _runner, _wide_plain_batch,
                               _with_quantized_head)

kernels = load_kernels()
pytestmark = pytest.mark.skipif(kernels is None or "avx512" not in kernels.float_linear_isas(),
                                reason="no AVX-512 decode stack")


def _stack_model(cfg=CONFIG):
    model = _model(cfg)
    assert pack_linears(model, _with_quantized_head(model, ["Q4_1"], "Q8_0"))
    assert model.decodes_tokens()
    return model


def _interruptible(batch):
    def make():
        made = batch()
        made.interruptible = True
        return made
    return make


@pytest.mark.parametrize("batch", [_plain_batch, _wide_plain_batch], ids=["team", "wide"])
def test_an_interrupted_step_stops_after_a_layer_and_runs_again_with_the_same_bits(batch):
    model = _stack_model()
    runner, start = _runner(model)
    reference = runner.execute(batch())  # the step as it runs with nobody interrupting
    reference_pool = _pool(runner)
    _restore(runner, start)

    model.interrupt_decode()
    stopped = runner.execute(_interruptible(batch)())
    assert stopped.interrupted and not stopped.sampled
    pool = _pool(runner)
    # The first layer's K/V went in; the second layer's pools are as they were.
    assert not torch.equal(pool[0][0], start[0][0])
    assert torch.equal(pool[1][0], start[1][0]) and torch.equal(pool[1][1], start[1][1])

    model.clear_decode_interrupt()
    again = runner.execute(_interruptible(batch)())
    assert not again.interrupted
    assert torch.equal(again.logits, reference.logits) and torch.equal(again.argmax, reference.argmax)
    assert all(torch.equal(a, b) for layer, ref in zip(_pool(runner), reference_pool) for a, b in zip(layer, ref))


def test_a_step_not_marked_interruptible_runs_to_its_end():
    model = _stack_model()
    runner, start = _runner(model)
    reference = runner.execute(_plain_batch())
    _restore(runner, start)
    model.interrupt_decode()
    step = runner.execute(_plain_batch())  # foreground work in it, say: it is not interruptible
    assert not step.interrupted and torch.equal(step.logits, reference.logits)
    # The request still stands for the next interruptible step until it is cleared.
    assert runner.execute(_interruptible(_plain_batch)()).interrupted


def test_the_engine_plans_a_stopped_batch_step_again_and_gives_the_same_tokens(tiny_model_fp32):
    cfg = dataclasses.replace(CONFIG, vocab_size=tiny_model_fp32.config.vocab_size)
    model = _stack_model(cfg)
    loaded = LoadedModel("stack-test", model, tiny_model_fp32.tokenizer, cfg)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run(interrupt_at: set[int], chat_at: int | None = None) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=4, enable_prefix_caching=False,
                                                background_priority=1000))
        engine.add_request([5, 17, 42, 9], params, "batch-a", priority=1000)
        engine.add_request([100, 3], params, "batch-b", priority=1000)
        answers, step = {}, 0
        while engine.has_unfinished_requests():
            if step == chat_at:
                engine.add_request([7] * 6, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "chat")
            if step in interrupt_at:
                engine.interrupt_background()
            answers.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            engine.clear_background_interrupt()
            step += 1
        return answers, engine

    plain, engine = run(set())
    assert engine.stats.interrupted == 0
    stopped, engine = run({2, 3, 5})  # decode steps of the batch alone
    assert engine.stats.interrupted == 3 and engine.snapshot().interrupted_steps == 3
    assert stopped == plain
    # A step carrying foreground work runs to its end whatever is asked.
    with_chat, engine = run({3, 4}, chat_at=3)
    assert engine.stats.interrupted == 0
    assert {k: v for k, v in with_chat.items() if k != "chat"} == plain and len(with_chat["chat"]) == 3


async def test_a_foreground_request_stops_the_batch_step_in_flight(tiny_model_fp32):
    """A foreground request reaching AsyncEngine stops a batch step already in its native call; the
    request runs next, and the batch ends as it would have."""
    cfg = dataclasses.replace(CONFIG, vocab_size=tiny_model_fp32.config.vocab_size)
    loaded = LoadedModel("stack-test", _stack_model(cfg), tiny_model_fp32.tokenizer, cfg)
    config = EngineConfig(num_blocks=64, block_size=4, enable_prefix_caching=False, background_priority=1000)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = LLMEngine(loaded, config).generate([[5, 17, 42, 9]], [params], use_tqdm=False)[0].token_ids

    engine = AsyncEngine(LLMEngine(loaded, config))
    runner, forwards = engine.engine.runner, []
    hand_over = runner.before_forward
    in_step, go_on = threading.Event(), threading.Event()

    def before_forward() -> None:  # on the engine thread, right before the native call
        forwards.append(1)
        if len(forwards) == 3:  # a decode step of the batch alone: the chat comes in as it starts
            in_step.set()
            go_on.wait(10)
        hand_over()

    runner.before_forward = before_forward
    try:
        batch = asyncio.create_task(engine.generate([5, 17, 42, 9], params, priority=1000))
        for _ in range(1000):
            if in_step.is_set():
                break
            await asyncio.sleep(0.01)
        chat = asyncio.create_task(engine.generate([7] * 6, SamplingParams(max_tokens=3, ignore_eos=True)))
        await asyncio.sleep(0)  # the chat's request is handed to the engine
        go_on.set()
        assert (await asyncio.wait_for(chat, 30)).num_output_tokens == 3
        assert engine.engine.stats.interrupted == 1
        assert (await asyncio.wait_for(batch, 30)).token_ids == expected
    finally:
        go_on.set()
        engine.shutdown()
