"""The engine step's breakdown for `chatloom bench latency`: each part's exclusive wall time.

An instrumented run wraps the matmuls, attention, layer ops, sampling, scheduling, metadata and
detokenizing with a clock that charges each call its own time minus its children's, so the parts add
up to the instrumented step. Decode steps normally run the whole decoder stack in one native call,
which cannot be timed part by part, so the instrumented run goes layer by layer; the plain decode step
is reported both ways.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from typing import Callable

from chatloom.engine import SamplingParams
from chatloom.engine.llm_engine import LLMEngine


class _Clock:
    """Exclusive wall time per category for nested, wrapped calls (one thread)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [category, start, time spent in children]

    def wrap(self, category: str, fn: Callable) -> Callable:
        stack, totals, clock = self._stack, self.totals, time.perf_counter

        def timed(*args, **kwargs):
            stack.append([category, clock(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                cat, start, children = stack.pop()
                spent = clock() - start
                totals[cat] += spent - children
                if stack:
                    stack[-1][2] += spent
        return timed


@contextlib.contextmanager
def instrumented(engine: LLMEngine):
    """Wrap the engine's parts in a _Clock for the duration; yields the clock."""
    from torch import nn

    import chatloom.models.llama as llama
    from chatloom.engine import detokenizer
    from chatloom.models.packed_linear import KernelLinear

    clock = _Clock()
    model = engine.runner.model
    patched: list[tuple[object, str, object]] = []  # (owner, attribute, what to put back; None: delete)

    def patch(owner, name: str, category: str) -> None:
        original = getattr(owner, name)
        # A method looked up through the class is shadowed on the instance, then deleted again.
        patched.append((owner, name, original if name in vars(owner) else None))
        setattr(owner, name, clock.wrap(category, original))

    patch(engine, "step", "python: engine step (postprocess, outputs)")
    patch(engine.scheduler, "schedule", "python: scheduler")
    patch(engine.runner, "_prepare", "python: step metadata")
    patch(engine.sampler, "sample", "sampling")
    patch(model, "logits_and_argmax", "sampling")  # its matmul is counted below as lm_head
    patch(llama, "paged_attention", "attention")
    if getattr(engine.runner.kernels, "decode_attention", None) is not None:
        patch(engine.runner.kernels, "decode_attention", "attention")  # a decode step's attention, in one call
    patch(detokenizer.IncrementalDetokenizer, "add", "detokenize")
    for m in model.modules():
        if isinstance(m, (KernelLinear, nn.Linear)):
            category = "matmul"
        elif isinstance(m, (llama.RMSNorm, llama.RotaryEmbedding, nn.Embedding, llama.MLP, llama.Attention)):
            category = "layer ops"  # norms, rotary, embedding, silu*mul, q/k/v split and views
        elif isinstance(m, (llama.DecoderLayer, llama.LlamaForCausalLM)):
            category = "python: model glue"
        else:
            continue
        patch(m, "forward", category)
    try:
        yield clock
    finally:
        for owner, name, original in reversed(patched):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def step_breakdown(engine: LLMEngine, prompt: list[int], decode_steps: int) -> dict:
    """One request at batch 1: the prefill step and `decode_steps` decode steps, plain and
    instrumented; per category, milliseconds per step (exclusive)."""
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)

    def run(clock: _Clock | None) -> tuple[float, list[float], dict[str, float]]:
        engine.add_request(prompt, params)
        t0 = time.perf_counter()
        engine.step()
        prefill = time.perf_counter() - t0
        prefill_parts = dict(clock.totals) if clock else {}
        if clock:
            clock.totals.clear()
        decodes = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            decodes.append(time.perf_counter() - t0)
        return prefill, decodes, prefill_parts

    model = engine.runner.model
    run(None)  # warm-up
    plain_prefill, plain_decodes, _ = run(None)
    # The parts can only be timed layer by layer: decode steps leave the native stack for this.
    native, model.native_decode = model.native_decode, False
    try:
        _, layered_decodes, _ = run(None)
        with instrumented(engine) as clock:
            inst_prefill, inst_decodes, prefill_parts = run(clock)
    finally:
        model.native_decode = native
    steps = len(inst_decodes)

    def parts(totals: dict[str, float], per: int) -> dict[str, float]:
        return {k: round(v / per * 1e3, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}

    return {
        "prompt_tokens": len(prompt),
        "decode": {"plain_step_ms": round(statistics.median(plain_decodes) * 1e3, 3),
                   "native_stack": native and model.decode_stack() is not None,
                   "layer_by_layer_step_ms": round(statistics.median(layered_decodes) * 1e3, 3),
                   "instrumented_step_ms": round(sum(inst_decodes) / steps * 1e3, 3),
                   "parts_ms": parts(clock.totals, steps)},
        "prefill": {"plain_step_ms": round(plain_prefill * 1e3, 3), "instrumented_step_ms": round(inst_prefill * 1e3, 3),
                    "parts_ms": parts(prefill_parts, 1)},
    }
