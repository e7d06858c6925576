"""The KV cache during a tool call: a round's blocks held for its resume, evicted, or given way."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.async_engine import AsyncEngine
from chatloom.engine.kv_holds import ToolTimes


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]


def _run(engine: LLMEngine, request_id: str) -> list[int]:
    for _ in range(500):  # a request kept out for good fails here instead of hanging
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.token_ids
    raise AssertionError(f"{request_id} never finished")


def _round_then_resume(engine: LLMEngine, policy: str, prompt: list[int], tool: list[int]):
    """One round that ends 'in a tool call', the decision, then the resume: (resume's tokens, its sequence)."""
    first = engine.add_request(prompt, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, keep_kv=True),
                               request_id=f"{policy}-round-0")
    answer = _run(engine, first)
    assert engine.hold_kv(first, ["lookup"], policy, 60.0) == policy
    resume = engine.add_request(prompt + answer + tool, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                                       resume_of=first),
                                request_id=f"{policy}-round-1")
    seq = engine.output_processor.requests[resume].seq
    return _run(engine, resume), seq, len(prompt + answer + tool)


def test_hold_prefills_only_the_tool_result_and_answers_as_evict_does(tiny_model):
    vocab = tiny_model.config.vocab_size
    prompt, tool = _tokens(vocab, 30, 1), _tokens(vocab, 7, 2)
    held = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=4))
    tokens_held, seq, length = _round_then_resume(held, "hold", prompt, tool)
    stats = held.kv_holds.snapshot()
    assert (stats.holds, stats.adopted, stats.resumes, stats.evictions) == (1, 1, 1, 0)
    # Everything the round computed (all but its last token) is adopted: only that token and the tool's prefill.
    assert seq.metrics.num_cached_tokens == 30 + 9 - 1
    assert stats.reprefilled_tokens == 0
    assert stats.blocks_held == 0 and held.kv_cache_manager.num_free_blocks == 64

    evicted = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=4))
    tokens_evicted, seq_e, _ = _round_then_resume(evicted, "evict", prompt, tool)
    stats_e = evicted.kv_holds.snapshot()
    assert (stats_e.holds, stats_e.evictions, stats_e.adopted) == (0, 1, 0)
    # Its full blocks came back from the prefix cache; the partial last one (2 of 38 tokens) was computed again.
    assert seq_e.metrics.num_cached_tokens == 36
    assert stats_e.reprefilled_tokens == 2
    assert tokens_held == tokens_evicted


def _busy(engine: LLMEngine, blocks_per_s: float) -> None:
    """As if the pool had handed out `blocks_per_s` blocks a second for the last second."""
    holds = engine.kv_holds
    holds._handouts.clear()
    holds._handouts.append((time.monotonic() - 1.0, engine.kv_cache_manager.pool.handed_out - int(blocks_per_s)))


def _kept_round(engine: LLMEngine, vocab: int, handle: str, seed: int = 3) -> None:
    """A round of 30 + 4 tokens (9 blocks of 4) that asked to keep its blocks, finished."""
    engine.add_request(_tokens(vocab, 30, seed), SamplingParams(max_tokens=4, ignore_eos=True, keep_kv=True),
                       request_id=handle)
    _run(engine, handle)


def test_auto_holds_only_where_the_cache_would_lose_the_blocks(tiny_model):
    roomy = LLMEngine(tiny_model, EngineConfig(num_blocks=256, block_size=4))
    for handle in ("quiet", "busy"):
        _kept_round(roomy, tiny_model.config.vocab_size, handle)
    # A quiet pool keeps freed blocks in the prefix cache for longer than the tool takes: evicting is free.
    _busy(roomy, 1.0)
    assert roomy.hold_kv("quiet", ["quick"], "auto", 60.0) == "evict"
    # A pool turning over 1000 blocks a second would hand them out: holding them is worth it.
    _busy(roomy, 1000.0)
    assert roomy.hold_kv("busy", ["quick"], "auto", 60.0) == "hold"


def test_a_tool_whose_times_spread_is_judged_by_its_long_calls():
    times = ToolTimes()
    for seconds in (2.6, 2.6, 2.6, 2.6):
        times.observe(("steady",), seconds)
    for seconds in (0.2, 5.0, 0.2, 5.0):
        times.observe(("erratic",), seconds)
    assert times.long(("steady",)) == times.expected(("steady",)) == 2.6
    assert times.expected(("erratic",)) < 2.6 < 6.0 < times.long(("erratic",))


def test_auto_holds_for_the_erratic_tool_and_evicts_for_the_steady_one(tiny_model):
    # 256 blocks, 9 of them the round's, turning over 50 a second: a freed block lasts about 4.9 s, and
    # SURVIVAL keeps a quarter of that, 1.2 s. Both tools took 1 s on average (the weighted means: 1.0 and
    # 0.9 s); only the erratic one has calls of 1.9 s.
    vocab = tiny_model.config.vocab_size
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256, block_size=4))
    for tool, seconds in (("steady", (1.0, 1.0, 1.0, 1.0)), ("erratic", (0.1, 1.9, 0.1, 1.9))):
        for s in seconds:
            engine.kv_holds.times.observe((tool,), s)
    for handle, tool, verdict in (("a", "steady", "evict"), ("b", "erratic", "hold")):
        _kept_round(engine, vocab, handle)
        _busy(engine, 50.0)
        assert engine.hold_kv(handle, [tool], "auto", 60.0) == verdict


@pytest.mark.parametrize("policy", ["hold", "evict"])
def test_a_tool_is_timed_from_the_callers_decision_to_its_resume_request(tiny_model, policy):
    vocab = tiny_model.config.vocab_size
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=4))
    engine.kv_holds.clock = lambda: 100.0
    _kept_round(engine, vocab, "round")
    # The engine gets to the decision and the resume between the same two steps (at 100.0), but the
    # caller asked for them 1.5 s apart: the tool took 1.5 s, not nothing.
    assert engine.hold_kv("round", ["lookup"], policy, 60.0, asked_at=98.0) == policy
    engine.add_request(_tokens(vocab, 40, 3), SamplingParams(max_tokens=2, ignore_eos=True, resume_of="round"),
                       asked_at=99.5)
    assert engine.kv_holds.times.expected(("lookup",)) == 1.5


def test_auto_holds_in_a_full_pool_nobody_waits_for(tiny_model):
    # The round's 9 blocks are all the pool has: evicted, the next request would take them; held, they
    # give way to it when it comes, so a full pool alone is no reason to evict.
    full = LLMEngine(tiny_model, EngineConfig(num_blocks=9, block_size=4))
    _kept_round(full, tiny_model.config.vocab_size, "full")
    _busy(full, 10.0)
    assert full.kv_cache_manager.num_free_blocks == 0
    assert full.hold_kv("full", ["lookup"], "auto", 60.0) == "hold"


def test_auto_evicts_for_a_tool_expected_to_outlast_the_hold(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=4))
    _kept_round(engine, tiny_model.config.vocab_size, "slow")
    engine.kv_holds.times.observe(("crawl",), 90.0)
    _busy(engine, 1000.0)
    assert engine.hold_kv("slow", ["crawl"], "auto", 60.0) == "evict"
    assert engine.kv_cache_manager.num_free_blocks == 64


def test_auto_evicts_when_waiting_requests_need_the_blocks(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=16, block_size=4))
    _kept_round(engine, tiny_model.config.vocab_size, "round")
    _busy(engine, 1000.0)
    # Two waiting requests need 9 blocks each: more than the 7 free and the round's 9 together.
    waiting = [engine.add_request(_tokens(tiny_model.config.vocab_size, 34, seed),
                                  SamplingParams(max_tokens=2, ignore_eos=True)) for seed in (7, 8)]
    assert engine.hold_kv("round", ["lookup"], "auto", 60.0) == "evict"
    assert all(len(_run(engine, w)) == 2 for w in waiting)


def test_the_hold_expected_to_wait_longest_gives_way_first(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=24, block_size=4, enable_prefix_caching=False))
    engine.kv_holds.times.observe(("quick",), 1.0)
    engine.kv_holds.times.observe(("slow",), 30.0)
    for handle, tool, seed in (("slow-round", "slow", 3), ("quick-round", "quick", 4)):
        _kept_round(engine, tiny_model.config.vocab_size, handle, seed)
        assert engine.hold_kv(handle, [tool], "hold", 600.0) == "hold"
    # 9 + 9 blocks held, 6 free: a request needing 10 takes the slow tool's round, not the quick one's.
    other = engine.add_request(_tokens(tiny_model.config.vocab_size, 40, 5), SamplingParams(max_tokens=4,
                                                                                             ignore_eos=True))
    _run(engine, other)
    assert set(engine.kv_holds.held) == {"quick-round"}
    assert engine.kv_holds.snapshot().pressure_releases == 1


def test_a_waiting_request_takes_held_blocks(tiny_model):
    vocab = tiny_model.config.vocab_size
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=16, block_size=4, enable_prefix_caching=False))
    rid = engine.add_request(_tokens(vocab, 30, 4), SamplingParams(max_tokens=4, ignore_eos=True, keep_kv=True))
    _run(engine, rid)
    assert engine.hold_kv(rid, ["slow"], "hold", 600.0) == "hold"
    assert engine.kv_holds.snapshot().blocks_held == 9
    # Another user's request needs 12 of the 16 blocks: the hold gives way rather than keep it waiting.
    other = engine.add_request(_tokens(vocab, 40, 5), SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(_run(engine, other)) == 4
    stats = engine.kv_holds.snapshot()
    assert (stats.pressure_releases, stats.blocks_held, stats.held_sequences) == (1, 0, 0)
    assert engine.hold_kv(rid, ["slow"], "hold", 600.0) == "gone"


def test_a_hold_ends_at_its_timeout_and_when_aborted(tiny_model):
    vocab = tiny_model.config.vocab_size

    async def main() -> None:
        engine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=4)))
        try:
            for rid, timeout in (("timed", 0.05), ("cancelled", 600.0)):
                async for _ in engine.stream(_tokens(vocab, 20, 6), SamplingParams(max_tokens=3, ignore_eos=True,
                                                                                   keep_kv=True), request_id=rid):
                    pass
                engine.hold_kv(rid, ["t"], "hold", timeout)
                if rid == "cancelled":
                    await _until(lambda: engine.snapshot().kv_holds.holds == 2)
                    engine.abort(rid)
                await _until(lambda: engine.snapshot().kv_holds.held_sequences == 0)
            stats = engine.snapshot().kv_holds
            assert (stats.holds, stats.timeouts, stats.blocks_held) == (2, 1, 0)
            assert engine.snapshot().kv_cache_free_blocks == 64
        finally:
            engine.shutdown()

    asyncio.run(main())


async def _until(condition) -> None:
    async with asyncio.timeout(30):
        while not condition():
            await asyncio.sleep(0.01)
