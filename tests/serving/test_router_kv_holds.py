"""A tool round's KV cache held on a replica: its resume goes back to that replica, which adopts it."""
from __future__ import annotations

import random

from chatloom.serving.backend import GenerationRequest
from chatloom.serving.router import Router, RouterConfig


async def _run(router: Router, request: GenerationRequest) -> tuple[list[int], object, str]:
    ids, last = [], None
    before = {r.name: r.served for r in router.replicas}
    async for d in router.stream(request):
        ids += d.token_ids or []
        last = d
    return ids, last, next(r.name for r in router.replicas if r.served > before[r.name])


async def test_the_resume_reaches_the_replica_that_holds_its_round(fleet):
    # Round robin would send the resume elsewhere: only the held round brings it back.
    router = Router("tiny-random", [r.url for r in fleet], RouterConfig(policy="round_robin", health_interval=0.2))
    await router.start()
    try:
        rng = random.Random(5)
        prompt = [rng.randrange(4, 200) for _ in range(37)]
        answer, _, first = await _run(router, GenerationRequest(prompt_token_ids=prompt, max_tokens=6, temperature=0,
                                                                request_id="tk-0", keep_kv=True))
        router.hold_kv("tk-0", ["lookup"], "hold", 60.0)
        tool = [rng.randrange(4, 200) for _ in range(5)]
        _, last, second = await _run(router, GenerationRequest(prompt_token_ids=prompt + answer + tool, max_tokens=4,
                                                               temperature=0, request_id="tk-1", resume_of="tk-0"))
        assert second == first
        # Everything the round computed came back, not just whole blocks from the prefix cache.
        assert last.cached_tokens == len(prompt) + len(answer) - 1
    finally:
        await router.close()
