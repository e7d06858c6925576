"""Seeded workloads shared by the benchmarks and the tests."""
from __future__ import annotations

import random
from dataclasses import dataclass


# Offline runs batch prompt work in bigger steps than a server (512, where a step's length is
# every stream's inter-token gap): fewer, larger prefill steps, and nobody waits on a token.
OFFLINE_TOKEN_BUDGET = 2048


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def standard_workload(num_requests: int, vocab_size: int, seed: int = 0, prompt_range: tuple[int, int] = (32, 256),
                      output_range: tuple[int, int] = (32, 256), avoid_ids: set[int] | None = None
                      ) -> list[BenchRequest]:
    """Random-token prompts uniform in prompt_range, output lengths uniform in output_range
    (generated with ignore_eos, so every request produces exactly its length)."""
    rng = random.Random(seed)
    avoid = avoid_ids or set()
    # Stay clear of the low ids where tokenizers keep their special tokens.
    low = min(vocab_size - 1, 300) if vocab_size > 600 else 0
    requests = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_range)
        ids = []
        while len(ids) < n:
            t = rng.randrange(low, vocab_size)
            if t not in avoid:
                ids.append(t)
        requests.append(BenchRequest(ids, rng.randint(*output_range)))
    return requests
