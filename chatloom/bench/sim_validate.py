"""`chatloom bench sim-validate`: the simulator against the real engine on this machine.

For each of two request rates, `bench serve`'s load (its prompts, chat-templated; Poisson arrivals
drawn as it draws them; greedy answers of up to --max-tokens) is run through the real engine in this
process with the server's engine settings, stepping as fast as it can in wall-clock time. The same
requests (arrival times, prompt token ids, and the output lengths the model really produced) are then
replayed through the simulator with the step-time model calibrated in the same run, and the two
throughputs, TTFT medians and TTFT 90th percentiles are compared. The HTTP layer is left out on both
sides: this checks the step-time model and the replayed scheduler, not the web server.
"""
from __future__ import annotations

import random
import statistics
import time

from chatloom.bench.calibrate import TimedEngine, run_calibrate
from chatloom.bench.serve import make_prompts
from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models.chat_template import render_chat
from chatloom.models.loader import LoadedModel
from chatloom.sim.hardware import ReplicaSpec
from chatloom.sim.replica import SimRequest
from chatloom.sim.simulator import SimConfig, Simulator
from chatloom.sim.step_time import BatchShape, StepTimeModel, load_step_time

# The server's engine settings (the settings tree's defaults).
SERVER_CONFIG = dict(kv_cache_gb=0.5, max_num_seqs=32, max_num_batched_tokens=512)


def _prompt_ids(loaded: LoadedModel, text: str) -> list[int]:
    tok = loaded.tokenizer
    rendered = render_chat(tok.chat_template, [{"role": "user", "content": text}], bos_token=tok.bos_token,
                           eos_token=tok.eos_token)
    has_bos = bool(tok.bos_token) and rendered.startswith(tok.bos_token)
    return tok.encode(rendered, add_special=not has_bos)


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """bench serve's Poisson arrivals: the same generator, the same draws."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        if i < n - 1:
            t += rng.expovariate(rate)
    return out


def run_real(loaded: LoadedModel, prompts: list[list[int]], times: list[float], max_tokens: int) -> dict:
    timed = TimedEngine(LLMEngine(loaded, EngineConfig(**SERVER_CONFIG)))
    engine = timed.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    first: dict[str, float] = {}
    done: dict[str, tuple[float, list[int]]] = {}
    i, n = 0, len(prompts)
    start = time.perf_counter()
    while i < n or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < n and times[i] <= now:
            engine.add_request(prompts[i], params, request_id=str(i))
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, times[i] - now))
            continue
        outs = timed.step()
        t = time.perf_counter() - start
        for o in outs:
            if o.request_id not in first and o.num_output_tokens > 0:
                first[o.request_id] = t
            if o.finished:
                done[o.request_id] = (t, list(o.token_ids or []))
    ids = [str(k) for k in range(n)]
    duration = max(t for t, _ in done.values())
    out_tokens = sum(len(toks) for _, toks in done.values())
    return {"ttft_s": [first[k] - times[int(k)] for k in ids], "duration_s": duration,
            "output_tokens": out_tokens, "outputs": [done[k][1] for k in ids],
            "kv_blocks": engine.kv_cache_manager.num_blocks, "max_model_len": engine.max_model_len,
            "prefix_hit_rate": engine.kv_cache_manager.hit_rate, "steps": timed.samples}


def run_simulated(loaded: LoadedModel, step_time: StepTimeModel, prompts, times, outputs, real: dict) -> dict:
    spec = ReplicaSpec(num_blocks=real["kv_blocks"], step_time=step_time, block_size=16,
                       max_num_seqs=SERVER_CONFIG["max_num_seqs"],
                       max_num_batched_tokens=SERVER_CONFIG["max_num_batched_tokens"],
                       max_model_len=real["max_model_len"], model_key=loaded.id)
    trace = [SimRequest(f"v{i}", t, list(p), list(o)) for i, (t, p, o) in enumerate(zip(times, prompts, outputs))
             if o]
    sim = Simulator(spec, 1, None, None, SimConfig(duration_s=times[-1] + 1.0, queue_timeout_s=1e9), trace=trace)
    run = sim.run()
    reqs = run.requests
    return {"ttft_s": [r.first_token - r.arrival for r in reqs], "duration_s": max(r.finished for r in reqs),
            "output_tokens": sum(len(r.answer) for r in reqs),
            "prefix_hit_rate": sim.replicas[0].kv.hit_rate}


def _figures(r: dict) -> dict:
    return {"output_throughput": round(r["output_tokens"] / r["duration_s"], 2),
            "ttft_p50_ms": round(1000 * statistics.median(r["ttft_s"]), 2),
            "ttft_p90_ms": round(1000 * statistics.quantiles(r["ttft_s"], n=10)[-1], 2),
            "duration_s": round(r["duration_s"], 3), "output_tokens": r["output_tokens"],
            "prefix_hit_rate": round(r["prefix_hit_rate"], 4)}


def auto_rates(step_time: StepTimeModel, prompt_tokens: float, max_tokens: int) -> list[float]:
    """A light and a heavy request rate for this machine: 25% and 60% of what the step-time model says
    one replica sustains at batch 16 (requests of `prompt_tokens` + `max_tokens`)."""
    ctx = prompt_tokens + max_tokens / 2
    decode = step_time.step_time(BatchShape(16, 0, int(16 * ctx), 0, 0))
    prefill = step_time.step_time(BatchShape(0, int(prompt_tokens), 0, prompt_tokens * (prompt_tokens + 1) / 2, 1))
    per_request = max_tokens * decode / 16 + prefill  # seconds of replica time per request at batch 16
    return [round(0.25 / per_request, 3), round(0.6 / per_request, 3)]


def step_model_error(step_time: StepTimeModel, samples) -> float:
    """Median relative error of the model on steps timed elsewhere (the real runs' own steps)."""
    errs = sorted(abs(step_time.step_time(s) - t) / t for s, t in samples if t > 0)
    return round(errs[len(errs) // 2], 4) if errs else float("nan")


def run_sim_validate(loaded: LoadedModel, rates: list[float] | None, num_prompts: int, max_tokens: int,
                     seed: int = 0, step_time_path: str | None = None, tolerance: float = 0.15) -> dict:
    calibration = None
    if step_time_path:
        step_time = load_step_time(step_time_path)
    else:
        step_time, calibration = run_calibrate(loaded, seed, SERVER_CONFIG["max_num_batched_tokens"],
                                               SERVER_CONFIG["max_num_seqs"])
    texts = make_prompts(num_prompts, seed)
    prompts = [_prompt_ids(loaded, t) for t in texts]
    if not rates:
        rates = auto_rates(step_time, sum(map(len, prompts)) / len(prompts), max_tokens)
    results = []
    for rate in rates:
        times = arrivals(num_prompts, rate, seed)
        real = run_real(loaded, prompts, times, max_tokens)
        sim = run_simulated(loaded, step_time, prompts, times, real["outputs"], real)
        fr, fs = _figures(real), _figures(sim)
        err_tp = fs["output_throughput"] / fr["output_throughput"] - 1
        err_ttft = fs["ttft_p50_ms"] / fr["ttft_p50_ms"] - 1
        err_p90 = fs["ttft_p90_ms"] / fr["ttft_p90_ms"] - 1
        results.append({"request_rate": rate, "measured": fr, "simulated": fs,
                        "step_model_median_error_on_these_steps": step_model_error(step_time, real["steps"]),
                        "throughput_error": round(err_tp, 4), "ttft_p50_error": round(err_ttft, 4),
                        "ttft_p90_error": round(err_p90, 4),
                        "within_tolerance": max(abs(err_tp), abs(err_ttft), abs(err_p90)) <= tolerance})
    return {"benchmark": "sim-validate", "model": loaded.id, "num_prompts": num_prompts, "max_tokens": max_tokens,
            "seed": seed, "engine": SERVER_CONFIG, "tolerance": tolerance,
            "step_time_model": step_time.to_dict(), "calibration_steps": calibration["steps_timed"] if calibration else None,
            "rates": results, "all_within_tolerance": all(r["within_tolerance"] for r in results)}
