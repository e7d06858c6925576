"""The cost of constrained decoding: engine step time with every request under a JSON-schema mask
against the same batch decoding freely, at several batch sizes, in one run.

Only full-batch decode steps are timed (every request past its prefill, none finished), so both sides
time the same work but for the mask. The grammar's own time is reported apart: computing the
allowed-token bitmasks with llguidance and applying them to the logits (mask), and the matchers
consuming the sampled tokens (consume), per step and per row.
"""
from __future__ import annotations

import statistics
import time

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.structured.constraint import Constraint
from chatloom.models.chat_template import encode_chat
from chatloom.models.loader import LoadedModel

SCHEMA = {
    "type": "object",
    "properties": {"fruits": {"type": "array", "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "color": {"type": "string"}, "sweet": {"type": "boolean"}},
        "required": ["name", "color", "sweet"]}}},
    "required": ["fruits"],
}
QUESTION = "List twenty fruits with their colour and whether they are sweet, as JSON."


def _timed_steps(engine: LLMEngine, batch: int) -> list[float]:
    """Run the engine dry; the durations of the steps that decoded the whole batch."""
    times = []
    while engine.has_unfinished_requests():
        states = list(engine.requests.values())
        full = len(states) == batch and all(s.seq.num_output_tokens >= 1 for s in states)
        t0 = time.perf_counter()
        engine.step()
        if full and len(engine.requests) == batch:
            times.append(time.perf_counter() - t0)
    return times


def _run(engine: LLMEngine, prompt: list[int], batch: int, max_tokens: int, constrained: bool, seed: int) -> dict:
    st = engine.guide.stats
    mask0_s, mask0_steps, mask0_rows, adv0_s = st.seconds, st.steps, st.rows, st.advance_seconds
    for i in range(batch):
        constraint = Constraint.json_schema(SCHEMA) if constrained else None
        # Free requests ignore EOS so the batch stays full for every step; a constrained one ends when its
        # JSON is complete (EOS is all its grammar allows then), so its batch may shrink near the end.
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i,
                                                  constraint=constraint, ignore_eos=not constrained))
    times = _timed_steps(engine, batch)
    st = engine.guide.stats
    mask_steps = st.steps - mask0_steps
    return {"step_ms": round(1000 * statistics.median(times), 3) if times else None, "timed_steps": len(times),
            "mask_ms_per_step": round(1000 * (st.seconds - mask0_s) / mask_steps, 3) if mask_steps else 0.0,
            "consume_ms_per_step": round(1000 * (st.advance_seconds - adv0_s) / mask_steps, 3) if mask_steps else 0.0,
            "mask_us_per_row": round(1e6 * (st.seconds - mask0_s) / (st.rows - mask0_rows), 1) if mask_steps else 0.0}


def run_structured(loaded: LoadedModel, batch_sizes: list[int], max_tokens: int = 48, repeats: int = 2,
                   seed: int = 0) -> dict:
    prompt = encode_chat(loaded.tokenizer, [{"role": "user", "content": QUESTION}])
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=max(batch_sizes), kv_cache_gb=1.0,
                                            enable_prefix_caching=True))
    # Warm up: the first constrained request builds llguidance's tokenizer (about a second, once).
    _run(engine, prompt, 1, 4, True, seed)
    _run(engine, prompt, 1, 4, False, seed)
    results = []
    for batch in batch_sizes:
        runs: dict[str, list[dict]] = {"free": [], "masked": []}
        for r in range(repeats):  # interleaved, so a shared machine's noise lands on both alike
            runs["free"].append(_run(engine, prompt, batch, max_tokens, False, seed + 1000 * r))
            runs["masked"].append(_run(engine, prompt, batch, max_tokens, True, seed + 1000 * r))
        free = statistics.median(x["step_ms"] for x in runs["free"] if x["step_ms"] is not None)
        masked = statistics.median(x["step_ms"] for x in runs["masked"] if x["step_ms"] is not None)
        mask = statistics.median(x["mask_ms_per_step"] for x in runs["masked"])
        consume = statistics.median(x["consume_ms_per_step"] for x in runs["masked"])
        results.append({"batch": batch, "step_ms_free": round(free, 3), "step_ms_masked": round(masked, 3),
                        "masked_vs_free": round(masked / free, 3), "mask_ms_per_step": round(mask, 3),
                        "consume_ms_per_step": round(consume, 3),
                        "grammar_share_of_masked_step": round((mask + consume) / masked, 3),
                        "mask_us_per_row": statistics.median(x["mask_us_per_row"] for x in runs["masked"]),
                        "runs": runs})
    return {"benchmark": "structured", "model": loaded.id, "grammar_library": "llguidance",
            "max_tokens": max_tokens, "repeats": repeats, "batches": results}
