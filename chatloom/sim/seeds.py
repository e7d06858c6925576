"""The design seeds' back-of-envelope fleet sizing, recomputed, beside what they state.

The seeds size a fleet with round numbers: 5,000 answers a second of ~500 tokens is 2.5 M tokens/s;
a server batching 32 conversations makes ~1,000 tokens/s (a 32 ms step), so ~2,500 servers; a 70B
model with grouped-query attention holds ~320 KB of KV per token, ~2.5 GB per 8,000-token
conversation; Little's law turns 29,000 messages/s held ~15 s each into ~450 K concurrent streams,
and ~200 conversations of KV per 8-GPU node into ~2,000 nodes. This module redoes that arithmetic so
the planner can print it next to the simulated answer; `seed_step_time` turns the seeds' batching
table (20 ms at batch 1, 25 ms at 8, 32 ms at 32) into a step-time model, so the simulator can run
the seeds' own server.
"""
from __future__ import annotations

from chatloom.models.config import ModelConfig
from chatloom.sim.step_time import BatchShape, LinearStepTime, fit_linear

# (batch, step seconds) from the seeds' batching table.
SEED_BATCH_TABLE = ((1, 0.020), (8, 0.025), (32, 0.032))


def seed_step_time(prefill_s_per_token: float = 0.0) -> LinearStepTime:
    """The seeds' server as a linear step-time model. The table prices decode only; a prompt token's
    cost, `prefill_s_per_token`, comes from elsewhere (the CLI takes the roofline's compute term for the
    model and GPU, since prefill is compute-bound)."""
    shapes = [BatchShape(b, 0, 0, 0, 0) for b, _ in SEED_BATCH_TABLE]
    # Three points, two free coefficients: fit the constant and the per-token cost only.
    fitted = fit_linear(shapes * 3, [t for _, t in SEED_BATCH_TABLE] * 3, source="the seeds' batching table")
    # The table is three round figures, not timed steps: its misfit to a line is no spread to draw from.
    fit = {k: v for k, v in fitted.fit.items() if k != "ratio_quantiles"}
    model = LinearStepTime(coef=fitted.coef, source=fitted.source, fit=fit)
    if prefill_s_per_token:
        coef = dict(model.coef, prefill_tokens=prefill_s_per_token)
        model = LinearStepTime(coef=coef, source=model.source + " + roofline prefill cost", fit=model.fit)
    return model


SEED_PEAK_TOKENS_PER_S = 2.5e6


def back_of_envelope(peak_tokens_per_s: float, cfg: ModelConfig, answer_tokens: float = 500.0,
                     batch: int = 32, step_s: float = 0.032, context_tokens: int = 8000,
                     kv_dtype: str = "fp16", conversations_per_node: int = 200,
                     messages_per_s: float = 29_000.0, hold_s: float = 15.0) -> list[dict]:
    """Each seed figure: what the seed says, the same arithmetic redone (at the seeds' own inputs), and
    their difference; then the seeds' method applied to `peak_tokens_per_s`."""
    tokens_per_server = batch / step_s
    seed_peak = SEED_PEAK_TOKENS_PER_S
    servers = seed_peak / tokens_per_server
    answers_per_s = seed_peak / answer_tokens
    answer_s = answer_tokens * step_s
    concurrent_at_peak = answers_per_s * answer_s  # Little's law
    kv_token = cfg.kv_bytes_per_token(kv_dtype)
    kv_conv = kv_token * context_tokens
    streams = messages_per_s * hold_s  # Little's law at average load
    rows = [
        ("tokens per server per second at batch 32", 1000.0, tokens_per_server, f"{batch} / {step_s * 1000:g} ms step"),
        ("servers for 2.5 M tokens/s", 2500.0, servers, f"{seed_peak:.3g} / {tokens_per_server:.0f}"),
        ("answers per second at peak", 5000.0, answers_per_s, f"{seed_peak:.3g} / {answer_tokens:g} tokens"),
        ("concurrent answers at peak (Little's law)", 80_000.0, concurrent_at_peak,
         f"{answers_per_s:.0f}/s x {answer_s:g} s"),
        ("KV bytes per token (70B, GQA, fp16)", 320 * 1024.0, float(kv_token),
         f"2 x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} x 2 bytes"),
        ("KV bytes per 8,000-token conversation", 2.5e9, float(kv_conv), f"{kv_token:,} x {context_tokens:,}"),
        ("concurrent streams at average load (Little's law)", 450_000.0, streams,
         f"{messages_per_s:,.0f}/s x {hold_s:g} s"),
        ("8-GPU nodes to hold those streams' KV", 2000.0, streams / conversations_per_node,
         f"{streams:,.0f} / {conversations_per_node} per node"),
    ]
    out = [{"figure": name, "seed": seed, "arithmetic": round(value, 3), "how": how,
            "difference": round(value / seed - 1, 4)} for name, seed, value, how in rows]
    out.append({"figure": "servers for this plan's peak by the seeds' method", "seed": None,
                "arithmetic": round(peak_tokens_per_s / tokens_per_server, 1),
                "how": f"{peak_tokens_per_s:.4g} / {tokens_per_server:.0f}", "difference": None})
    return out
