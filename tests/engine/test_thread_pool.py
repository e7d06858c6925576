"""Threads give back their OpenMP pools (engine/thread_pool.py), and torch keeps working after."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from chatloom.engine import EngineConfig, SamplingParams
from chatloom.engine.async_engine import AsyncEngine
from chatloom.engine.thread_pool import _libgomp, release_thread_pool, then_release

needs_libgomp = pytest.mark.skipif(_libgomp() is None, reason="no libgomp in this build of torch")


@needs_libgomp
def test_a_thread_releases_its_pool_and_parallel_work_still_runs():
    x = torch.randn(4096, 512)
    want = x.sum(dim=1)
    results = []

    def work():
        results.append(torch.equal(x.sum(dim=1), want))  # a parallel region: this thread gets a pool
        results.append(release_thread_pool())
        results.append(torch.equal(x.sum(dim=1), want))  # and a fresh one after
        results.append(release_thread_pool())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert results == [True, True, True, True]


def test_then_release_passes_results_and_errors_through():
    assert then_release(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ValueError, match="bad"):
        then_release(lambda: (_ for _ in ()).throw(ValueError("bad")))


async def test_the_engine_answers_the_same_after_going_idle(tiny_model_fp32, monkeypatch):
    """The engine thread releases its pool whenever it runs out of work; the next request makes a
    new one and must get the same greedy tokens."""
    import chatloom.engine.async_engine as async_engine

    released = []
    monkeypatch.setattr(async_engine, "release_thread_pool", lambda: released.append(release_thread_pool()))
    engine = AsyncEngine.from_model(tiny_model_fp32, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    try:
        first = (await engine.generate([5, 6, 7, 8], params)).token_ids
        for _ in range(100):  # the engine thread goes idle right after the last output
            if released:
                break
            await asyncio.sleep(0.01)
        assert len(released) == 1
        again = (await engine.generate([5, 6, 7, 8], params)).token_ids
        assert len(first) == 12 and again == first
    finally:
        engine.shutdown()
