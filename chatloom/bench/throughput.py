"""Offline throughput: continuous batching against static batches and one-at-a-time.

All three modes run the same model code and kernels; only the scheduling differs.
- continuous: every request submitted at once; the engine rebuilds the batch each step.
- static: fixed batches; prompts padded to the longest in the batch and every member
  decoded until the longest output is done (what a plain `transformers` server does).
  Only each request's own tokens count as output.
- sequential: one request at a time.
"""
from __future__ import annotations

import time

from chatloom.bench.workload import OFFLINE_TOKEN_BUDGET, BenchRequest
from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models.loader import LoadedModel

MODES = ("continuous", "static", "sequential")


def pool_blocks_for(requests: list[BenchRequest], block_size: int = 16, extra_len: int = 0) -> int:
    """A KV pool just big enough for every request at once: no mode is starved of memory."""
    return sum(-(-(len(r.prompt_token_ids) + extra_len + r.output_len) // block_size) for r in requests) + 8


def _engine(loaded: LoadedModel, max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int,
            chunked: bool = True) -> LLMEngine:
    # Prefix caching off: throughput should not depend on accidental prompt overlap.
    return LLMEngine(loaded, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                          enable_prefix_caching=False, num_blocks=num_blocks,
                                          enable_chunked_prefill=chunked))


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _result(mode: str, requests: list[BenchRequest], seconds: float, **extra) -> dict:
    out_tokens = sum(r.output_len for r in requests)
    return {"mode": mode, "requests": len(requests), "output_tokens": out_tokens,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests), "seconds": round(seconds, 3),
            "output_tokens_per_s": round(out_tokens / seconds, 2), **extra}


def run_continuous(loaded: LoadedModel, requests: list[BenchRequest], max_num_seqs: int = 64,
                   max_num_batched_tokens: int = OFFLINE_TOKEN_BUDGET) -> dict:
    engine = _engine(loaded, max_num_seqs, max_num_batched_tokens, pool_blocks_for(requests))
    t0 = time.perf_counter()
    outs = engine.generate([r.prompt_token_ids for r in requests], [_params(r.output_len) for r in requests],
                           use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert all(o.num_output_tokens == r.output_len for o, r in zip(outs, requests))
    return _result("continuous", requests, seconds, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, steps=engine.stats.steps,
                   preemptions=engine.scheduler.num_preemptions)


def run_static(loaded: LoadedModel, requests: list[BenchRequest], batch_size: int = 32) -> dict:
    pad = (loaded.tokenizer.eos_token_ids or [0])[0]
    # Padding can add up to the longest prompt to each request.
    longest_prompt = max(len(r.prompt_token_ids) for r in requests)
    longest_output = max(r.output_len for r in requests)
    engine = _engine(loaded, batch_size, 1 << 30,
                     batch_size * -(-(2 * longest_prompt + longest_output) // 16) + 8, chunked=False)
    t0 = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        longest = max(r.output_len for r in batch)
        # Left-pad to the longest prompt; decode everyone until the longest is done.
        prompts = [[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
        engine.generate(prompts, _params(longest), use_tqdm=False)
    seconds = time.perf_counter() - t0
    return _result("static", requests, seconds, batch_size=batch_size)


def run_sequential(loaded: LoadedModel, requests: list[BenchRequest]) -> dict:
    engine = _engine(loaded, 1, 1 << 30, max(pool_blocks_for([r]) for r in requests))
    t0 = time.perf_counter()
    for r in requests:
        engine.generate([r.prompt_token_ids], _params(r.output_len), use_tqdm=False)
    seconds = time.perf_counter() - t0
    return _result("sequential", requests, seconds)


def run_mode(mode: str, loaded: LoadedModel, requests: list[BenchRequest], *, max_num_seqs: int = 64,
             max_num_batched_tokens: int = OFFLINE_TOKEN_BUDGET, static_batch_size: int = 32) -> dict:
    if mode == "continuous":
        return run_continuous(loaded, requests, max_num_seqs, max_num_batched_tokens)
    if mode == "static":
        return run_static(loaded, requests, static_batch_size)
    if mode == "sequential":
        return run_sequential(loaded, requests)
    raise ValueError(f"unknown mode {mode!r} (use {', '.join(MODES)})")
