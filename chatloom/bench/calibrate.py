"""`chatloom bench calibrate`: time the real engine's steps and fit the simulator's step-time model.

Each step of the real engine is timed (schedule + forward + sample + detokenize, what a step costs
a server) beside the batch shape its scheduler planned. The workload mixes phases so the fit can
tell the terms apart: decode-only batches of many sizes, short and long contexts, chunked prefills
alone and mixed with decodes, and requests joining running batches of several sizes one at a time
(the serving regime: one short prefill chunk beside the decodes). The fit
(chatloom.sim.step_time.fit_linear) is least squares with non-negative coefficients.
"""
from __future__ import annotations

import random
import time

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models.loader import LoadedModel
from chatloom.sim.step_time import BatchShape, LinearStepTime, fit_linear, shape_of

# (number of requests, prompt length range, output length range) per phase: decode batches of many
# sizes over short and longer contexts, chunked prefills alone and mixed with decodes. Small enough
# to run in a minute or two on a busy two-core machine.
PHASES = [
    (1, (16, 32), (12, 12)), (4, (16, 64), (12, 16)), (12, (32, 96), (12, 16)), (24, (32, 96), (12, 16)),
    (32, (40, 80), (8, 12)), (6, (200, 400), (8, 12)), (2, (700, 900), (4, 6)),
]

# The serving regime: requests joining a running decode batch one at a time, so a step holds one short
# prefill chunk beside the decodes, as under Poisson arrivals. (decode batch, joiners, prompt range.)
STAGGERED = [(1, 4, (8, 48)), (2, 4, (8, 48)), (4, 4, (8, 48)), (8, 4, (8, 48)), (16, 4, (8, 48))]
JOIN_EVERY = 3  # steps between joiners


class TimedEngine:
    """An LLMEngine whose steps are timed beside the shape of what its scheduler planned."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.samples: list[tuple[BatchShape, float]] = []
        self._shape: BatchShape | None = None
        schedule = engine.scheduler.schedule

        def planned():
            batch = schedule()
            self._shape = shape_of(batch) if batch else None
            return batch
        engine.scheduler.schedule = planned  # instance attribute: this engine only

    def step(self):
        self._shape = None
        t0 = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t0
        if self._shape is not None:
            self.samples.append((self._shape, dt))
        return outs


def calibration_engine(loaded: LoadedModel, max_num_batched_tokens: int = 512, max_num_seqs: int = 64) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                          num_blocks=1024, enable_prefix_caching=False))


def run_calibrate(loaded: LoadedModel, seed: int = 0, max_num_batched_tokens: int = 512,
                  max_num_seqs: int = 64, rounds: int = 1) -> tuple[LinearStepTime, dict]:
    """Time every step of the calibration phases; return the fitted model and a JSON-ready summary."""
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size
    low = min(300, vocab // 2)
    timed = TimedEngine(calibration_engine(loaded, max_num_batched_tokens, max_num_seqs))
    # Warm up (kernels, allocator) outside the samples.
    timed.engine.generate([[low + 1] * 64], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for n, (plo, phi), (olo, ohi) in PHASES:
            for _ in range(n):
                prompt = [rng.randrange(low, vocab) for _ in range(rng.randint(plo, phi))]
                timed.engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(olo, ohi), temperature=0,
                                                                ignore_eos=True))
            while timed.engine.has_unfinished_requests():
                timed.step()
        for batch, joiners, (plo, phi) in STAGGERED:
            hold = SamplingParams(max_tokens=JOIN_EVERY * (joiners + 1), temperature=0, ignore_eos=True)
            for _ in range(batch):
                timed.engine.add_request([rng.randrange(low, vocab) for _ in range(rng.randint(16, 64))], hold)
            for _ in range(joiners):
                for _ in range(JOIN_EVERY):
                    timed.step()
                prompt = [rng.randrange(low, vocab) for _ in range(rng.randint(plo, phi))]
                timed.engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            while timed.engine.has_unfinished_requests():
                timed.step()
    seconds = time.perf_counter() - t0
    shapes = [s for s, _ in timed.samples]
    model = fit_linear(shapes, [t for _, t in timed.samples],
                       source=f"chatloom bench calibrate: {loaded.id}, budget {max_num_batched_tokens} tokens")
    summary = {"benchmark": "calibrate", "model": loaded.id, "steps_timed": len(shapes),
               "seconds": round(seconds, 2), "step_time_model": model.to_dict()}
    return model, summary
