"""The router over real replica processes: placement by prefix, failover mid-answer, ejection and recovery."""
from __future__ import annotations

import asyncio
import time

import pytest

from chatloom.serving import Constraint
from chatloom.serving.backend import BackendError, BackendNotReady, BadGenerationRequest, GenerationRequest
from chatloom.serving.router import Router, RouterConfig

from fleet_testing import ReplicaProcess


async def collect(backend, request):
    parts, last = [], None
    async for d in backend.stream(request):
        parts.append(d.text)
        last = d
    return parts, last


async def wait_until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


def fast_config(policy: str) -> RouterConfig:
    return RouterConfig(policy=policy, health_interval=0.2, eject_after=2, recover_after=2)


async def test_prefix_aware_sends_the_next_turn_where_the_history_is(fleet, tiny_tokenizer):
    router = Router("tiny-random", [r.url for r in fleet], fast_config("prefix_aware"), tiny_tokenizer)
    await router.start()
    try:
        await wait_until(lambda: all(r.has_feed for r in router.replicas))
        history = [{"role": "system", "content": "You are a helpful assistant. " * 8}]
        placed = []
        for turn in range(4):
            history.append({"role": "user", "content": f"question number {turn} about routing " * 3})
            before = {r.name: r.served for r in router.replicas}
            parts, last = await collect(router, GenerationRequest(messages=history, max_tokens=8, temperature=0))
            placed.append(next(r.name for r in router.replicas if r.served > before[r.name]))
            history.append({"role": "assistant", "content": "".join(parts)})
            # The feed reports the blocks this turn stored before the next turn is routed.
            await asyncio.sleep(0.3)
        assert len(set(placed)) == 1, placed  # every turn went where its history was cached
        assert last.cached_tokens > 0
        # An unrelated conversation with no cached prefix anywhere goes to the least loaded replica.
        other = {r.name: r.served for r in router.replicas}
        await collect(router, GenerationRequest(prompt="zzzz unrelated " * 10, max_tokens=2, temperature=0))
        assert sum(r.served for r in router.replicas) == sum(other.values()) + 1
    finally:
        await router.close()


async def test_a_tight_class_target_skips_the_replica_expected_to_miss_it(fleet, tiny_tokenizer):
    """The router learns each replica's time to first token from its answers; a request whose class
    target that replica is expected to miss goes elsewhere, one with a loose target follows its prefix."""
    config = fast_config("prefix_aware")
    config.class_targets = True
    router = Router("tiny-random", [r.url for r in fleet], config, tiny_tokenizer)
    await router.start()
    try:
        await wait_until(lambda: all(r.has_feed for r in router.replicas))
        history = [{"role": "user", "content": "a long question about class targets " * 12}]
        await collect(router, GenerationRequest(messages=history, max_tokens=2, temperature=0))
        home = next(r for r in router.replicas if r.served)
        ids = await router.prompt_ids(GenerationRequest(messages=history))
        await wait_until(lambda: home.index.matched(router._block_keys(home, ids, {})) > 0)  # the feed told it
        assert home.state(0, len(ids)).expected_ttft_s is not None  # learned from that answer
        home.ttft.expected = lambda waiting, prefill: 30.0  # as if its first tokens had lately been slow

        async def placed(target):
            before = {r.name: r.served for r in router.replicas}
            await collect(router, GenerationRequest(messages=history, max_tokens=2, temperature=0,
                                                    ttft_target_s=target))
            return next(r for r in router.replicas if r.served > before[r.name])

        assert await placed(60.0) is home  # a loose target keeps the cache hit
        config.class_targets = False  # off (the default): the prefix decides
        assert await placed(1.0) is home
        config.class_targets = True
        assert await placed(1.0) is not home  # (after this the history is cached there too)
    finally:
        await router.close()


async def test_sigkill_mid_answer_every_answer_complete_and_identical(fleet, tiny_tokenizer):
    prompts = [f"story {i}: once upon a time there was a router " for i in range(6)]

    async def run_all(router):
        async def one(p):
            return await collect(router, GenerationRequest(prompt=p, max_tokens=600, temperature=0))
        return await asyncio.gather(*(one(p) for p in prompts))

    router = Router("tiny-random", [r.url for r in fleet], fast_config("round_robin"), tiny_tokenizer)
    await router.start()
    try:
        expected = await run_all(router)
    finally:
        await router.close()
    victim = fleet[0]
    router = Router("tiny-random", [r.url for r in fleet], fast_config("round_robin"), tiny_tokenizer)
    await router.start()
    try:
        task = asyncio.ensure_future(run_all(router))
        # Kill the first replica once it is mid-answer on its requests.
        vr = next(r for r in router.replicas if r.name == victim.url)
        await wait_until(lambda: vr.inflight >= 2, 30)
        await asyncio.sleep(0.1)
        assert vr.inflight >= 1
        victim.kill()
        got = await asyncio.wait_for(task, 120)
        assert router.failovers >= 1
        for (parts, last), (exp_parts, exp_last) in zip(got, expected):
            assert "".join(parts) == "".join(exp_parts)  # no gap, no repeat, same greedy text
            assert last.finish_reason == exp_last.finish_reason == "length"
            assert last.completion_tokens == exp_last.completion_tokens == 600
        assert any(last.failovers for _, last in got)
        assert not vr.healthy  # ejected
    finally:
        await router.close()
        victim.launch().wait_ready()


async def test_ejected_replica_returns_after_recovery(fleet, tiny_tokenizer, caplog):
    victim = fleet[1]
    router = Router("tiny-random", [r.url for r in fleet], fast_config("least_load"), tiny_tokenizer)
    await router.start()
    try:
        vr = next(r for r in router.replicas if r.name == victim.url)
        victim.kill()
        await wait_until(lambda: not vr.healthy, 10)
        assert any("ejected" in rec.getMessage() for rec in caplog.records)
        # Requests keep being served by the others meanwhile.
        for _ in range(3):
            _, last = await collect(router, GenerationRequest(prompt="hello", max_tokens=3, temperature=0))
            assert last.finish_reason == "length"
        victim.launch().wait_ready()
        await wait_until(lambda: vr.healthy, 20)
        before = vr.served
        for _ in range(6):
            await collect(router, GenerationRequest(prompt="hello again", max_tokens=2, temperature=0))
        assert vr.served > before  # it takes work again
    finally:
        await router.close()
        if victim.proc.poll() is not None:
            victim.launch().wait_ready()


async def test_draining_takes_no_new_work_but_finishes_answers(fleet, tiny_tokenizer):
    router = Router("tiny-random", [r.url for r in fleet[:2]], fast_config("round_robin"), tiny_tokenizer)
    await router.start()
    try:
        router.drain(fleet[0].url)
        drained = router.replicas[0]
        for _ in range(4):
            await collect(router, GenerationRequest(prompt="hi", max_tokens=2, temperature=0))
        assert drained.served == 0 and router.replicas[1].served == 4
        with pytest.raises(ValueError):
            router.drain("http://127.0.0.1:1")
    finally:
        await router.close()


async def test_bad_replica_urls_fail_at_start_with_reasons_and_never_hang(fleet, tiny_tokenizer):
    router = Router("tiny-random", ["http://127.0.0.1:9"], fast_config("round_robin"), tiny_tokenizer)
    t0 = time.monotonic()
    with pytest.raises(BackendNotReady, match="no replica of 'tiny-random' can serve.*connection refused"):
        await router.start()
    assert time.monotonic() - t0 < 5
    await router.close()
    wrong = Router("other-model", [fleet[0].url], fast_config("round_robin"))
    with pytest.raises(BackendNotReady, match="serves tiny-random, not 'other-model'"):
        await wrong.start()
    await wrong.close()
    # One good and one dead replica: it starts, the dead one ejected, requests still served.
    mixed = Router("tiny-random", [fleet[0].url, "http://127.0.0.1:9"], fast_config("round_robin"), tiny_tokenizer)
    await mixed.start()
    try:
        assert [r.healthy for r in mixed.replicas] == [True, False]
        _, last = await collect(mixed, GenerationRequest(prompt="hi", max_tokens=2, temperature=0))
        assert last.finish_reason == "length"
        # A grammar cannot travel to replicas: refused with a clear 400 rather than answered unconstrained.
        with pytest.raises(BadGenerationRequest, match="structured output"):
            await collect(mixed, GenerationRequest(prompt="hi", constraint=Constraint.regex("[0-9]+")))
        # Nor do several choices or logprobs survive an answer moving to another replica.
        for extra, param in (({"n": 2}, "n"), ({"logprobs": 1}, "logprobs")):
            with pytest.raises(BadGenerationRequest, match="not supported through the router") as refused:
                await collect(mixed, GenerationRequest(prompt="hi", **extra))
            assert refused.value.param == param
    finally:
        await mixed.close()
