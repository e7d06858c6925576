"""The engine step's breakdown for `chatloom bench latency`: each part's exclusive wall time.

An instrumented run wraps the matmuls, attention, layer ops, sampling, scheduling, metadata and
detokenizing with a clock that charges each call its own time minus its children's, so the parts add
up to the instrumented step. Decode steps normally run the whole decoder stack in one native call,
which Python cannot time part by part, so the instrumented run goes layer by layer; the plain decode step
is reported both ways. Where that native call runs on the decode team (decode_team.cpp), the team's own
profile splits it: each matmul phase (with its weight bytes and the GB/s it read them at), attention and
the serial parts, and what the step spends outside the native call (scheduling, sampling, Python).
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


# The team profile's matmul parts and the modules of each layer (or the model) whose weights they read.
_TEAM_MATMULS = {"qkv": ("self_attn", "qkv_proj"), "o": ("self_attn", "o_proj"), "gate_up": ("mlp", "gate_up_proj"),
                 "down": ("mlp", "down_proj")}


def _weight_bytes(module) -> int:
    """Bytes a matmul module reads per step: its parameters and buffers (codes, scales, panels)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]
               if t is not None)


def _team_weights(model) -> dict[str, int]:
    """Weight bytes per team matmul part, over all layers; the head's under "head"."""
    out = {part: sum(_weight_bytes(getattr(getattr(layer, a), b)) for layer in model.layers)
           for part, (a, b) in _TEAM_MATMULS.items()}
    out["head"] = _weight_bytes(model.lm_head)
    return out


def team_breakdown(engine: LLMEngine, prompt: list[int], decode_steps: int) -> dict | None:
    """One request's plain decode steps with the decode team's profile on: per part milliseconds a step
    (the matmul phases with their weight MB and GB/s), the native call's time and the rest of the step
    outside it. None where decode steps do not run on the team."""
    model = engine.runner.model
    stack = model.decode_stack() if getattr(model, "native_decode", False) else None
    if stack is None or not stack.team_path:
        return None
    clock = _Clock()
    names = [n for n in ("decode_tokens", "decode_argmax", "decode_logits", "forward") if hasattr(model, n)]
    for name in names:  # instance attributes shadow the methods, deleted again below
        setattr(model, name, clock.wrap("native", getattr(model, name)))
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    steps_ms = []
    try:
        engine.add_request(prompt, params)
        engine.step()  # the prefill, not profiled
        stack.set_profiling(True)
        clock.totals.clear()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            steps_ms.append((time.perf_counter() - t0) * 1e3)
        parts = stack.profile()
    finally:
        stack.set_profiling(False)
        for name in names:
            delattr(model, name)
    steps = int(parts.pop("steps"))
    redone = int(parts.pop("redone"))
    if steps == 0:
        return None
    weights = _team_weights(model)
    team = {}
    for part, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        ms = seconds / steps * 1e3
        row = {"ms": round(ms, 3)}
        if part in weights and ms > 0:
            row["weights_mb"] = round(weights[part] / 1e6, 1)
            row["gb_per_s"] = round(weights[part] / 1e6 / ms, 1)
        team[part] = row
    step = statistics.median(steps_ms)
    native = clock.totals["native"] / len(steps_ms) * 1e3
    team_ms = sum(parts.values()) / steps * 1e3
    return {"steps": steps, "redone_items": redone, "step_ms": round(step, 3), "native_call_ms": round(native, 3),
            "team_ms": round(team_ms, 3), "outside_native_ms": round(sum(steps_ms) / len(steps_ms) - native, 3),
            "weights_mb": round(sum(weights.values()) / 1e6, 1), "parts": team}


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
    team = team_breakdown(engine, prompt, decode_steps)
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
                   "parts_ms": parts(clock.totals, steps), "team": team},
        "prefill": {"plain_step_ms": round(plain_prefill * 1e3, 3), "instrumented_step_ms": round(inst_prefill * 1e3, 3),
                    "parts_ms": parts(prefill_parts, 1)},
    }
