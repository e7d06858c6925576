"""`chatloom bench latency`: where one user's time goes, layer by layer, in one run.

The same prompts (chat messages rendered by the model's template) go through every layer of
the stack, each layer wrapping the one before:

- engine: `LLMEngine.add_request` + `step()` in this thread (no serving at all);
- async: `AsyncEngine.stream` (the engine thread, the hand-off to the event loop);
- backend: `LocalBackend.stream` (chat template, tokenizing, the Delta stream the app reads);
- openai: POST /v1/chat/completions with stream=True over loopback HTTP to the app (auth,
  caps, moderation, quota, admission, output guard, SSE, uvicorn);
- conversations: POST /conversations/{id}/messages (the product's own API: the message saved,
  the prompt assembled, the generation job, the event log, SSE).

TTFT is request sent -> first text received; TPOT = (last text - first text) / (tokens - 1), with
the token count the layer reports. Each layer's overhead is its figure minus the engine's. Layers
run interleaved (every layer for one prompt, then the next prompt), so noise from a shared
machine lands on all of them alike. Prefix caching is off in every engine so that no layer
profits from a prompt an earlier layer already ran.

The engine step's own breakdown (matmuls, attention, layer ops, sampling, scheduling, metadata,
detokenizing, the rest of the Python) comes from a separate instrumented run (step_breakdown.py).
The instrumentation's own cost is reported (the instrumented step minus a plain one), so the
Python share is an upper bound.
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from chatloom.bench.serve import ASKS, TOPICS
from chatloom.engine import EngineConfig, SamplingParams
from chatloom.engine.async_engine import AsyncEngine
from chatloom.engine.llm_engine import LLMEngine
from chatloom.engine.thread_pool import then_release
from chatloom.bench.step_breakdown import step_breakdown
from chatloom.models.loader import LoadedModel

LAYERS = ("engine", "async", "backend", "openai", "conversations")
SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly and concisely."


@dataclass
class Sample:
    """One request as a layer saw it (seconds)."""

    ttft: float
    tpot: float | None
    output_tokens: int
    prompt_tokens: int = 0


@dataclass
class Timeline:
    """Arrival times of a request's text pieces, and the counts its layer reports at the end."""

    start: float
    arrivals: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0

    def sample(self) -> Sample:
        if not self.arrivals:
            raise RuntimeError("the request produced no text")
        ttft = self.arrivals[0] - self.start
        n = self.output_tokens
        tpot = (self.arrivals[-1] - self.arrivals[0]) / (n - 1) if n > 1 else None
        return Sample(ttft, tpot, n, self.prompt_tokens)


# -- prompts ----------------------------------------------------------------------------

def make_messages(tokenizer, target_tokens: int, nonce: int) -> list[dict]:
    """A system prompt and a user message whose content is about `target_tokens` tokens of
    plain English, unique per nonce (so no two requests share more than the system prompt)."""
    rng = random.Random(nonce)
    sentences = [f"Request number {nonce}."]
    while len(" ".join(sentences)) < target_tokens * 8:
        sentences.append(rng.choice(ASKS).format(t=rng.choice(TOPICS)))
    ids = tokenizer.encode(" ".join(sentences), add_special=False)[:max(1, target_tokens)]
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": tokenizer.decode(ids).strip()}]


# -- the layers ---------------------------------------------------------------------------

def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
    """All prompts added at once, then stepped to the end in this thread."""
    lines: dict[str, Timeline] = {}
    for ids in prompts:
        start = time.perf_counter()
        rid = engine.add_request(ids, params)
        lines[rid] = Timeline(start, prompt_tokens=len(ids))
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            line = lines[out.request_id]
            if out.delta_text:
                line.arrivals.append(now)
            if out.finished:
                line.output_tokens = out.num_output_tokens
    return [line.sample() for line in lines.values()]


async def _gather(coros) -> list[Sample]:
    return list(await asyncio.gather(*coros))


async def run_async(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
    async def one(ids: list[int]) -> Sample:
        line = Timeline(time.perf_counter(), prompt_tokens=len(ids))
        async for out in engine.stream(ids, params):
            if out.delta_text:
                line.arrivals.append(time.perf_counter())
            if out.finished:
                line.output_tokens = out.num_output_tokens
        return line.sample()
    return await _gather(one(p) for p in prompts)


async def run_backend(backend, conversations: list[list[dict]], max_tokens: int) -> list[Sample]:
    from chatloom.serving import GenerationRequest

    async def one(messages: list[dict]) -> Sample:
        line = Timeline(time.perf_counter())
        request = GenerationRequest(messages=messages, max_tokens=max_tokens, temperature=0.0)
        async for delta in backend.stream(request):
            if delta.text:
                line.arrivals.append(time.perf_counter())
            if delta.finished:
                line.output_tokens, line.prompt_tokens = delta.completion_tokens, delta.prompt_tokens
        return line.sample()
    return await _gather(one(m) for m in conversations)


async def _sse_data(response: httpx.Response):
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


async def run_openai(client: httpx.AsyncClient, headers: dict, model: str, conversations: list[list[dict]],
                     max_tokens: int) -> list[Sample]:
    async def one(messages: list[dict]) -> Sample:
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        line = Timeline(time.perf_counter())
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"/v1/chat/completions answered {r.status_code}: {(await r.aread())[:200]!r}")
            async for chunk in _sse_data(r):
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        line.arrivals.append(time.perf_counter())
                if chunk.get("usage"):
                    line.output_tokens = chunk["usage"]["completion_tokens"]
                    line.prompt_tokens = chunk["usage"]["prompt_tokens"]
        return line.sample()
    return await _gather(one(m) for m in conversations)


async def run_conversations(client: httpx.AsyncClient, headers: dict, conversations: list[list[dict]],
                            max_tokens: int) -> list[Sample]:
    """The product API; the app's system prompt is the one the other layers send, so the prompts match."""
    async def one(messages: list[dict]) -> Sample:
        r = await client.post("/conversations", headers=headers)
        r.raise_for_status()
        cid = r.json()["id"]
        body = {"text": messages[-1]["content"], "max_tokens": max_tokens, "temperature": 0}
        line = Timeline(time.perf_counter())
        async with client.stream("POST", f"/conversations/{cid}/messages", json=body, headers=headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"/conversations/.../messages answered {r.status_code}: {(await r.aread())[:200]!r}")
            async for event in _sse_data(r):
                if "token" in event and event["token"]:
                    line.arrivals.append(time.perf_counter())
                if event.get("done"):
                    usage = event.get("usage") or {}
                    line.output_tokens = usage.get("completion_tokens", len(line.arrivals))
                    line.prompt_tokens = usage.get("prompt_tokens", 0)
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
        return line.sample()
    return await _gather(one(m) for m in conversations)


# -- a loopback server ------------------------------------------------------------------------

class LoopbackServer:
    """The app served by uvicorn on 127.0.0.1 in a background thread (its own event loop)."""

    def __init__(self, app) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="bench-uvicorn", daemon=True)

    def __enter__(self) -> "LoopbackServer":
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the loopback server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


# -- the engine step, taken apart ---------------------------------------------------------------

# -- the whole run -------------------------------------------------------------------------------

def _stats(samples: list[Sample]) -> dict:
    ttft = [s.ttft * 1e3 for s in samples]
    tpot = [s.tpot * 1e3 for s in samples if s.tpot is not None]
    return {"ttft_ms_p50": round(statistics.median(ttft), 3), "ttft_ms_mean": round(statistics.fmean(ttft), 3),
            "tpot_ms_p50": round(statistics.median(tpot), 3) if tpot else None,
            "tpot_ms_mean": round(statistics.fmean(tpot), 3) if tpot else None,
            "output_tokens_mean": round(statistics.fmean(s.output_tokens for s in samples), 1),
            "prompt_tokens_mean": round(statistics.fmean(s.prompt_tokens for s in samples), 1),
            "requests": len(samples)}


async def _run_layers(loaded: LoadedModel, prompt_lengths: list[int], in_flight: list[int], repeats: int,
                      max_tokens: int, layers: list[str], engine_config: EngineConfig, breakdown_steps: int) -> dict:
    from chatloom.app.main import create_app
    from chatloom.settings import Settings
    from chatloom.serving import LocalBackend

    tok = loaded.tokenizer
    engine = LLMEngine(loaded, engine_config)
    async_engine = AsyncEngine(LLMEngine(loaded, engine_config))
    backend = LocalBackend(loaded, engine_config=engine_config)
    await backend.start()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    samples: dict[tuple[str, int, int], list[Sample]] = defaultdict(list)
    nonce = 0
    with tempfile.TemporaryDirectory(prefix="chatloom-latency-") as data_dir:
        # New accounts start on the free tier; here it is wide enough that quotas never refuse the benchmark.
        tiers = Path(data_dir) / "tiers.toml"
        tiers.write_text("[free]\ntokens_per_minute = 100000000\ntokens_per_day = 1000000000\n"
                         "requests_per_minute = 1000000\nmax_concurrent = 1024\nmax_tokens = 100000\n")
        settings = Settings(server={"data_dir": data_dir, "log_level": "warning"}, accounts={"jwt_secret": "bench-latency-" + "0" * 32, "argon2_time_cost": 1, "argon2_memory_kib": 1024}, chat={"system_prompt": SYSTEM_PROMPT, "tools": ""}, traffic={"tiers_file": str(tiers)}, engine={"max_num_seqs": engine_config.max_num_seqs}, sampling={"max_tokens_limit": max(4096, max_tokens)})  # tool definitions would lengthen one layer's prompt
        app = create_app(settings, backend)
        with LoopbackServer(app) as server:
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
            async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
                r = await client.post("/auth/signup", json={"username": "latency", "password": "bench latency pw"})
                r.raise_for_status()
                headers = {"Authorization": f"Bearer {r.json()['token']}"}
                model_id = backend.default_model
                for rep in range(repeats + 1):  # the first round warms every layer up and is not counted
                    for n_prompt in prompt_lengths:
                        for width in in_flight:
                            convs = []
                            for _ in range(width):
                                nonce += 1
                                convs.append(make_messages(tok, n_prompt, nonce))
                            ids = [backend.encode_messages(m) for m in convs]
                            for layer in layers:
                                if layer == "engine":
                                    got = then_release(run_engine, engine, ids, params)  # see thread_pool.py
                                elif layer == "async":
                                    got = await run_async(async_engine, ids, params)
                                elif layer == "backend":
                                    got = await run_backend(backend, convs, max_tokens)
                                elif layer == "openai":
                                    got = await run_openai(client, headers, model_id, convs, max_tokens)
                                else:
                                    got = await run_conversations(client, headers, convs, max_tokens)
                                if rep:
                                    samples[(layer, n_prompt, width)].extend(got)
    breakdown = {str(n): step_breakdown(engine, backend.encode_messages(make_messages(tok, n, 10**6 + n)),
                                        breakdown_steps) for n in prompt_lengths}
    async_engine.shutdown()
    await backend.close()
    results = []
    for n_prompt in prompt_lengths:
        for width in in_flight:
            row = {"prompt_tokens_target": n_prompt, "in_flight": width, "layers": {}}
            base = _stats(samples[(layers[0], n_prompt, width)])
            for layer in layers:
                s = _stats(samples[(layer, n_prompt, width)])
                s["ttft_overhead_ms"] = round(s["ttft_ms_p50"] - base["ttft_ms_p50"], 3)
                if s["tpot_ms_p50"] is not None and base["tpot_ms_p50"] is not None:
                    s["tpot_overhead_ms"] = round(s["tpot_ms_p50"] - base["tpot_ms_p50"], 3)
                row["layers"][layer] = s
            results.append(row)
    return {"cases": results, "engine_step_breakdown": breakdown}


def run_latency(loaded: LoadedModel, prompt_lengths: list[int], in_flight: list[int], repeats: int = 3,
                max_tokens: int = 32, layers: list[str] | None = None, breakdown_steps: int = 32,
                num_blocks: int | None = None) -> dict:
    """Every layer, every prompt length and width; then the engine step's breakdown."""
    layers = list(layers or LAYERS)
    unknown = sorted(set(layers) - set(LAYERS))
    if unknown:
        raise ValueError(f"unknown layer(s) {', '.join(unknown)}; choose from {', '.join(LAYERS)}")
    longest = max(prompt_lengths) + 64 + max_tokens  # the template and system prompt take some tokens too
    if num_blocks is None:
        num_blocks = max(64, -(-longest // 16) * max(in_flight) + 16)
    config = EngineConfig(num_blocks=num_blocks, enable_prefix_caching=False,
                          max_num_seqs=max(64, max(in_flight)), max_model_len=max(2048, longest))
    t0 = time.perf_counter()
    out = asyncio.run(_run_layers(loaded, prompt_lengths, in_flight, repeats, max_tokens, layers, config,
                                  breakdown_steps))
    return {"benchmark": "latency", "model": loaded.id, "layers": layers, "prompt_lengths": prompt_lengths,
            "in_flight": in_flight, "repeats": repeats, "max_tokens": max_tokens,
            "torch_threads": torch.get_num_threads(), **out,
            "seconds": round(time.perf_counter() - t0, 1)}


def format_table(result: dict) -> str:
    """Layers x cases: TTFT p50 and TPOT p50 (ms), with the overhead over the engine alone."""
    lines = [f"{'prompt':>6} {'inflight':>8} {'layer':<14} {'TTFT p50':>9} {'(+eng)':>8} {'TPOT p50':>9} {'(+eng)':>8}"
             f" {'out tok':>7}"]
    for case in result["cases"]:
        for layer, s in case["layers"].items():
            tpot = "-" if s["tpot_ms_p50"] is None else f"{s['tpot_ms_p50']:.2f}"
            lines.append(f"{case['prompt_tokens_target']:>6} {case['in_flight']:>8} {layer:<14} "
                         f"{s['ttft_ms_p50']:>9.2f} {s['ttft_overhead_ms']:>+8.2f} {tpot:>9} "
                         f"{s.get('tpot_overhead_ms', 0.0):>+8.2f} {s['output_tokens_mean']:>7}")
    for n, b in result["engine_step_breakdown"].items():
        for kind in ("prefill", "decode"):
            d = b[kind]
            layered = (f"layer by layer {d['layer_by_layer_step_ms']:.2f} ms, " if d.get("native_stack") else "")
            lines.append(f"engine step, {kind}, prompt {b['prompt_tokens']} tokens: plain {d['plain_step_ms']:.2f} ms, "
                         f"{layered}instrumented {d['instrumented_step_ms']:.2f} ms")
            lines.extend(f"    {k:<44} {v:8.3f} ms" for k, v in d["parts_ms"].items())
            if team := d.get("team"):
                lines.append(f"  on the decode team: step {team['step_ms']:.2f} ms, native call {team['native_call_ms']:.2f} ms "
                             f"(team {team['team_ms']:.2f} ms), outside it {team['outside_native_ms']:.2f} ms; "
                             f"{team['weights_mb']:.0f} MB of weights a step")
                for part, row in team["parts"].items():
                    rate = f"  {row['weights_mb']:7.1f} MB {row['gb_per_s']:6.1f} GB/s" if "gb_per_s" in row else ""
                    lines.append(f"    {part:<44} {row['ms']:8.3f} ms{rate}")
    return "\n".join(lines)
