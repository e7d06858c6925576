"""A burst of new requests goes through the router's placement a few at a time."""
from __future__ import annotations

import asyncio

import pytest

from chatloom.serving.backend import BadGenerationRequest, GenerationRequest
from chatloom.serving.opening_gate import OpeningGate
from chatloom.serving.router import Router, RouterConfig


async def test_a_request_waits_while_every_place_is_taken():
    gate = OpeningGate(limit=2, hold_s=60)
    first, second = await gate.enter(), await gate.enter()
    third = asyncio.ensure_future(gate.enter())
    await asyncio.sleep(0)
    assert not third.done() and gate.inside == 2
    first()
    first()  # giving a place back twice frees it once
    leave_third = await asyncio.wait_for(third, 5)
    assert gate.inside == 2
    fourth = asyncio.ensure_future(gate.enter())
    await asyncio.sleep(0)
    assert not fourth.done()
    second()
    leave_third()
    await asyncio.wait_for(fourth, 5)
    assert gate.inside == 1


async def test_a_place_held_too_long_is_given_back_on_its_own():
    gate = OpeningGate(limit=1, hold_s=0.01)
    await gate.enter()  # never given back by its holder
    leave = await asyncio.wait_for(gate.enter(), 5)
    assert gate.inside == 1
    leave()
    assert gate.inside == 0


async def test_no_limit_lets_everyone_through():
    gate = OpeningGate(limit=0, hold_s=1)
    leaves = [await gate.enter() for _ in range(100)]
    assert gate.inside == 0
    leaves[0]()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="limit"):
        OpeningGate(limit=-1, hold_s=1)
    with pytest.raises(ValueError, match="hold_s"):
        OpeningGate(limit=1, hold_s=0)


@pytest.mark.parametrize("limit", [1, 0])
async def test_the_router_places_at_most_its_limit_at_once(fleet, tiny_tokenizer, limit):
    router = Router("tiny-random", [r.url for r in fleet], RouterConfig(opening_limit=limit, opening_hold_s=30),
                    tiny_tokenizer)
    tokenizing, most, calls = 0, 0, 0
    real_prompt_ids = router.prompt_ids

    async def slow_prompt_ids(request):
        nonlocal tokenizing, most, calls
        tokenizing += 1
        calls += 1
        this_call = calls
        most = max(most, tokenizing)
        try:
            await asyncio.sleep(0.02)  # a replica's /tokenize round trip
            if this_call == 2:
                raise ConnectionError("replica gone while tokenizing")
            return await real_prompt_ids(request)
        finally:
            tokenizing -= 1

    router.prompt_ids = slow_prompt_ids
    await router.start()
    try:
        async def one(i: int) -> str:
            request = GenerationRequest(prompt=f"request {i}", max_tokens=3, temperature=0)
            try:
                return "".join([d.text async for d in router.stream(request)])
            except ConnectionError:
                return "failed"

        answers = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), 60)
        # The one that failed while placing gave its place back: every other one ran.
        assert answers.count("failed") == 1 and all(isinstance(a, str) for a in answers)
        assert most == 1 if limit == 1 else most > 1
        assert router._opening.inside == 0
    finally:
        await router.close()


async def test_a_streaming_answer_does_not_keep_its_place(fleet, tiny_tokenizer):
    router = Router("tiny-random", [r.url for r in fleet], RouterConfig(opening_limit=1, opening_hold_s=600),
                    tiny_tokenizer)
    await router.start()
    try:
        long = router.stream(GenerationRequest(prompt="a long answer", max_tokens=500, temperature=0))
        await anext(long)  # streaming, and left waiting between two tokens
        assert router._opening.inside == 0
        short = GenerationRequest(prompt="another user", max_tokens=3, temperature=0)
        assert await asyncio.wait_for(_text(router, short), 30)
        await long.aclose()
    finally:
        await router.close()


async def test_a_prompt_too_long_gives_its_place_back(fleet, tiny_tokenizer):
    router = Router("tiny-random", [r.url for r in fleet], RouterConfig(opening_limit=1, opening_hold_s=600),
                    tiny_tokenizer)
    await router.start()
    try:
        too_long = GenerationRequest(prompt="word " * (router.context_window + 10), max_tokens=3)
        with pytest.raises(BadGenerationRequest, match="context window"):
            await _text(router, too_long)
        assert router._opening.inside == 0
        short = GenerationRequest(prompt="another user", max_tokens=3, temperature=0)
        assert await asyncio.wait_for(_text(router, short), 30)
    finally:
        await router.close()


async def _text(router: Router, request: GenerationRequest) -> str:
    return "".join([d.text async for d in router.stream(request)])
