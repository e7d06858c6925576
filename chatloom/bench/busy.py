"""`chatloom bench busy`: one stream's TPOT on a quiet machine and beside busy-loop processes.

A server rarely has the machine to itself: a gateway, a database or Redis take a core now and
then. Losing one of two cores should cost a decode step about 2x; a step whose threads wait for
each other at every matmul loses far more. This runs the same greedy request again and again,
alternating a quiet round with a round where `neighbours` processes spin beside the engine
(`python -c 'while True: pass'`), so that drift on a shared machine lands on both alike, and
reports the medians and their ratio.
"""
from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from typing import Iterator

from chatloom.bench.workload import standard_workload
from chatloom.engine import EngineConfig, SamplingParams
from chatloom.engine.llm_engine import LLMEngine
from chatloom.models.loader import LoadedModel


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[list[subprocess.Popen]]:
    """`count` processes that each keep a core busy until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.2)  # let them reach their loop before anything is timed
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def time_per_output_token(engine: LLMEngine, prompt: list[int], max_tokens: int) -> float:
    """One request alone, greedy, exactly max_tokens long: (last token - first token) / (tokens - 1)."""
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    first = last = 0.0
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.delta_token_ids:
                last = time.perf_counter()
                first = first or last
                tokens += len(out.delta_token_ids)
    if tokens < 2:
        raise RuntimeError("the request produced fewer than two tokens")
    return (last - first) / (tokens - 1)


def run_busy(loaded: LoadedModel, rounds: int = 5, prompt_tokens: int = 64, max_tokens: int = 32,
             neighbours: int = 1, seed: int = 0) -> dict:
    """Quiet and busy TPOT, alternated for `rounds` rounds after a warm-up; medians in milliseconds."""
    if rounds < 1 or max_tokens < 2 or neighbours < 1:
        raise ValueError("rounds and neighbours must be at least 1, max_tokens at least 2")
    (request,) = standard_workload(1, loaded.config.vocab_size, seed, (prompt_tokens, prompt_tokens),
                                   avoid_ids=set(loaded.tokenizer.eos_token_ids))
    engine = LLMEngine(loaded, EngineConfig(enable_prefix_caching=False))
    time_per_output_token(engine, request.prompt_token_ids, max_tokens)  # warm-up
    quiet: list[float] = []
    busy: list[float] = []
    for _ in range(rounds):
        quiet.append(time_per_output_token(engine, request.prompt_token_ids, max_tokens))
        with busy_neighbours(neighbours):
            busy.append(time_per_output_token(engine, request.prompt_token_ids, max_tokens))
    q, b = statistics.median(quiet), statistics.median(busy)
    return {
        "benchmark": "busy", "model": loaded.id, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
        "neighbours": neighbours, "rounds": rounds,
        "quiet_tpot_ms": [round(x * 1e3, 2) for x in quiet], "busy_tpot_ms": [round(x * 1e3, 2) for x in busy],
        "quiet_tpot_p50_ms": round(q * 1e3, 2), "busy_tpot_p50_ms": round(b * 1e3, 2),
        "busy_over_quiet": round(b / q, 2),
    }
