"""Seed the planner's cost model by timing forwards over n tokens before serving.

Without it the planner would only ever have seen the step sizes it already chose, and
could not tell that checking four more tokens at batch 1 costs almost nothing. The
timed forwards write K/V into blocks no sequence owns yet (this runs while the pool is
empty), over a short context, as one sequence carrying n - 1 proposed tokens.
"""
from __future__ import annotations

import time

import torch

from chatloom.engine.config import EngineConfig
from chatloom.engine.model_runner import ModelRunner
from chatloom.engine.scheduler import ScheduledBatch
from chatloom.engine.sampling_params import SamplingParams
from chatloom.engine.sequence import Sequence
from chatloom.engine.spec_decode.planner import CostModel

_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 96, 128, 192, 256)
_CONTEXT = 32  # tokens already in the cache for the timed sequence


def time_forward(runner: ModelRunner, n: int, num_blocks: int) -> float:
    """Seconds for one decode forward over n query tokens (one sequence, n - 1 proposed)."""
    bs = runner.block_size
    ctx = min(_CONTEXT, max(0, num_blocks * bs - n - 1))
    seq = Sequence("calibration", [0] * (ctx + 1), SamplingParams(max_tokens=1))
    seq.num_computed_tokens = ctx
    seq.spec_token_ids = [0] * (n - 1)
    seq.block_table = list(range(-(-(ctx + n) // bs)))
    t0 = time.perf_counter()
    runner.execute(ScheduledBatch(decodes=[seq]))
    return time.perf_counter() - t0


def calibrate(cost: CostModel, runner: ModelRunner, num_blocks: int, max_tokens: int, repeats: int = 3) -> None:
    sizes = [n for n in _SIZES if n <= max_tokens and n < num_blocks * runner.block_size - 1]
    with torch.inference_mode():
        time_forward(runner, 1, num_blocks)  # warm-up: first calls allocate and load kernels
        for n in sizes:
            cost.observe(n, min(time_forward(runner, n, num_blocks) for _ in range(repeats)))


def calibrate_decoder(decoder, runner: ModelRunner, config: EngineConfig) -> None:
    """The target's cost model, and the draft's when it has one."""
    num_blocks = len(runner.kv_caches[0][0])
    calibrate(decoder.cost, runner, num_blocks, config.max_num_batched_tokens)
    draft_runner = getattr(decoder.proposer, "runner", None)
    if decoder.draft_cost is not None and draft_runner is not None:
        calibrate(decoder.draft_cost, draft_runner, len(draft_runner.kv_caches[0][0]), config.max_num_seqs)
