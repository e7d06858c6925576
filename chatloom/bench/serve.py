"""`chatloom bench serve`: a load generator for any OpenAI-compatible server.

Requests arrive as a Poisson process at --request-rate (or all at once, bounded by --max-concurrency),
each a streamed /v1/chat/completions call with stream_options.include_usage. Metrics follow vLLM's
definitions so figures compare with its benchmark_serving:

- TTFT: request sent -> first content token received.
- TPOT: (latency - TTFT) / (output tokens - 1), per request, for requests with more than one token.
- ITL: gaps between successive content chunks.
- E2EL: request sent -> last byte.
- goodput: completed requests that meet every SLO given (--goodput ttft:MS tpot:MS e2el:MS), per second.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

TOPICS = ["the water cycle", "how a bicycle stays upright", "the history of paper", "why the sky is blue",
          "how vaccines work", "the rules of chess", "how bread rises", "what a compiler does",
          "the life of a star", "how tides happen", "what DNS is", "how bees make honey",
          "the causes of seasons", "how a refrigerator works", "what inflation means", "how volcanoes form"]
ASKS = ["Explain {t} to a ten-year-old.", "Write three short facts about {t}.",
        "Give a one-paragraph summary of {t}.", "What is the most surprising thing about {t}?"]
SLO_KEYS = ("ttft", "tpot", "e2el")


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(ASKS).format(t=rng.choice(TOPICS)) for _ in range(n)]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MILLISECONDS with KEY one of {', '.join(SLO_KEYS)}, got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if slos[key] <= 0:
            raise ValueError(f"--goodput {item!r}: must be positive")
    return slos


@dataclass
class Result:
    ok: bool = False
    status: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def one_request(client: httpx.AsyncClient, url: str, headers: dict, model: str, prompt: str | list[dict],
                      max_tokens: int, extra: dict | None = None) -> Result:
    """One streamed greedy chat request; `prompt` is the user's message or the whole message list, `extra`
    adds fields to the body (e.g. vLLM's ignore_eos)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0, **(extra or {})}
    result = Result()
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            result.status = str(r.status_code)
            if r.status_code != 200:
                result.error = (await r.aread()).decode(errors="replace")[:200]
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.status, result.error = "stream_error", str(chunk["error"])[:200]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last)
                        last = now
                        chunks += 1
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = last is not None or result.output_tokens == 0
        if not result.ok:
            result.status = "no_output"
    except (httpx.HTTPError, ValueError) as exc:
        result.status, result.error = f"exception:{type(exc).__name__}", str(exc)[:200]
    return result


def percentiles(values: list[float], scale: float = 1000.0) -> dict:
    """mean, p50, p90, p99 in milliseconds (linear interpolation between ranks)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(values)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"mean": round(sum(xs) / len(xs) * scale, 3),
            **{f"p{p}": round(pct(p) * scale, 3) for p in (50, 90, 99)}}


def meets(result: Result, slos: dict[str, float]) -> bool:
    got = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return result.ok and all(got[k] * 1000 <= v for k, v in slos.items())


async def run_serve(base_url: str, model: str, num_prompts: int, request_rate: float | None = None,
                    max_concurrency: int | None = None, api_key: str | None = None, max_tokens: int = 64,
                    goodput: dict[str, float] | None = None, seed: int = 0, timeout_s: float = 600.0) -> dict:
    """Run the load and return the figures as a dict (JSON-ready)."""
    prompts = make_prompts(num_prompts, seed)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or num_prompts, max_keepalive_connections=64)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def limited(prompt: str) -> Result:
            if limit is None:
                return await one_request(client, url, headers, model, prompt, max_tokens)
            async with limit:
                return await one_request(client, url, headers, model, prompt, max_tokens)

        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(prompt)))
            if request_rate and i < len(prompts) - 1:
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    done = [r for r in results if r.ok]
    errors = Counter(r.status for r in results if not r.ok)
    out_tokens = sum(r.output_tokens for r in done)
    slos = goodput or {}
    return {
        "benchmark": "serve", "base_url": base_url, "model": model, "num_prompts": num_prompts,
        "request_rate": request_rate or "inf", "max_concurrency": max_concurrency, "max_tokens": max_tokens,
        "seed": seed, "completed": len(done), "failed": len(results) - len(done),
        "errors_by_status": dict(sorted(errors.items())),
        "duration_s": round(duration, 3),
        "total_input_tokens": sum(r.prompt_tokens for r in done), "total_output_tokens": out_tokens,
        "request_throughput": round(len(done) / duration, 3) if duration else None,
        "output_throughput": round(out_tokens / duration, 2) if duration else None,
        "ttft_ms": percentiles([r.ttft for r in done]),
        "tpot_ms": percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": percentiles([x for r in done for x in r.itls]),
        "e2el_ms": percentiles([r.latency for r in done]),
        "slo_ms": slos or None,
        "goodput": round(sum(1 for r in done if meets(r, slos)) / duration, 3) if slos and duration else None,
        "sample_errors": [r.error for r in results if r.error][:3],
    }
