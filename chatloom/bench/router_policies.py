"""`chatloom bench router`: multi-turn chat against N local replicas, once per routing policy.

The workload is the one routing is for: many users at once, one shared system prompt, and every turn
resending the whole conversation. A replica that served a user's previous turn holds that history in
its prefix cache and prefills only the new message; any other replica recomputes all of it. Each
policy runs the same conversations (greedy answers, so the same work) on the same replicas, their
prefix caches reset in between, so the figures compare policies and nothing else.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx

from chatloom.serving.backend import GenerationRequest
from chatloom.serving.remote import Timeouts
from chatloom.serving.router import Router, RouterConfig

WORDS = ("cache block replica router prefix token answer question system engine queue memory model batch "
         "latency stream user history turn policy load fleet server request decode prefill window share "
         "river mountain garden kitchen window planet music letter morning evening story number color").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def conversations(users: int, turns: int, seed: int, system_words: int, user_words: int) -> tuple[str, list[list[str]]]:
    """A shared system prompt and, per user, the text of each turn's message."""
    rng = random.Random(seed)
    system = "You are a helpful assistant for a team. " + _text(rng, system_words)
    return system, [[_text(rng, user_words) for _ in range(turns)] for _ in range(users)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def _run_policy(model: str, urls: list[str], policy: str, tokenizer, system: str, convs: list[list[str]],
                      max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=30) as http:
        for url in urls:  # every policy starts from cold caches
            (await http.post(url + "/reset_prefix_cache")).raise_for_status()
    # A benchmark measures placement, not failover: generous timeouts, so that a machine busy with other
    # work slows the run down instead of ejecting replicas.
    slow_ok = Timeouts(connect=30.0, probe=30.0, stream_connect=60.0, between_chunks=600.0)
    router = Router(model, urls, RouterConfig(policy=policy, health_interval=0.5, eject_after=10, timeouts=slow_ok),
                    tokenizer)
    await router.start()
    records: list[dict] = []
    try:
        deadline = time.monotonic() + 10
        while not all(r.has_feed for r in router.replicas) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # feeds caught up with the reset

        async def user(u: int, turns: list[str]) -> None:
            history = [{"role": "system", "content": system}]
            for t, message in enumerate(turns):
                history.append({"role": "user", "content": message})
                t0 = time.monotonic()
                ttft, parts, last = None, [], None
                async for d in router.stream(GenerationRequest(messages=list(history), max_tokens=max_tokens,
                                                               temperature=0.0)):
                    if ttft is None and (d.text or d.finished):
                        ttft = time.monotonic() - t0
                    parts.append(d.text)
                    last = d
                records.append({"user": u, "turn": t, "ttft": ttft, "e2e": time.monotonic() - t0,
                                "prompt_tokens": last.prompt_tokens, "cached_tokens": last.cached_tokens,
                                "completion_tokens": last.completion_tokens})
                history.append({"role": "assistant", "content": "".join(parts)})

        t0 = time.monotonic()
        await asyncio.gather(*(user(u, turns) for u, turns in enumerate(convs)))
        wall = time.monotonic() - t0
    finally:
        await router.close()
    ttfts = [r["ttft"] for r in records]
    turns = max(r["turn"] for r in records) + 1
    prompt = sum(r["prompt_tokens"] for r in records)
    return {
        "requests": len(records), "wall_s": round(wall, 2),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4), "ttft_p90_s": round(percentile(ttfts, 0.9), 4),
        "ttft_mean_s": round(statistics.mean(ttfts), 4),
        "throughput_tok_s": round(sum(r["completion_tokens"] for r in records) / wall, 2),
        "requests_per_s": round(len(records) / wall, 3),
        "prompt_tokens": prompt,
        "prefix_hit_rate": round(sum(r["cached_tokens"] for r in records) / prompt, 4) if prompt else 0.0,
        "ttft_mean_by_turn_s": [round(statistics.mean(r["ttft"] for r in records if r["turn"] == t), 4)
                                for t in range(turns)],
    }


async def _warm_up(urls: list[str], text: str) -> None:
    """One short request per replica, so a fresh process's first-request costs (lazy allocations, pages
    swapped in) fall on no policy's figures."""
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(http.post(u + "/v1/completions", json={"prompt": text, "max_tokens": 2})
                               for u in urls))


def run_router_bench(model: str, urls: list[str], policies: list[str], users: int, turns: int, max_tokens: int,
                     seed: int = 0, system_words: int = 120, user_words: int = 40) -> dict:
    """Run the workload once per policy against the replicas at `urls`; JSON-ready results."""
    from chatloom.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    system, convs = conversations(users, turns, seed, system_words, user_words)
    asyncio.run(_warm_up(urls, system))
    results = {p: asyncio.run(_run_policy(model, urls, p, tokenizer, system, convs, max_tokens)) for p in policies}
    out: dict = {"workload": {"users": users, "turns": turns, "max_tokens": max_tokens, "replicas": len(urls),
                              "system_prompt_tokens": len(tokenizer.encode(system)), "seed": seed},
                 "policies": results}
    base = results.get("round_robin")
    if base:
        out["vs_round_robin"] = {
            p: {"ttft_p90_speedup": round(base["ttft_p90_s"] / r["ttft_p90_s"], 2) if r["ttft_p90_s"] else None,
                "ttft_p50_speedup": round(base["ttft_p50_s"] / r["ttft_p50_s"], 2) if r["ttft_p50_s"] else None,
                "throughput_ratio": round(r["throughput_tok_s"] / base["throughput_tok_s"], 2)
                if base["throughput_tok_s"] else None}
            for p, r in results.items() if p != "round_robin"}
    return out


def table(result: dict) -> str:
    rows = [f"{'policy':<14} {'TTFT p50':>10} {'TTFT p90':>10} {'tok/s':>8} {'req/s':>7} {'prefix hit':>10}"]
    for p, r in result["policies"].items():
        rows.append(f"{p:<14} {r['ttft_p50_s'] * 1000:>8.0f}ms {r['ttft_p90_s'] * 1000:>8.0f}ms "
                    f"{r['throughput_tok_s']:>8.1f} {r['requests_per_s']:>7.2f} {r['prefix_hit_rate'] * 100:>9.1f}%")
    return "\n".join(rows)


def plot(result: dict, path: str) -> None:
    """TTFT per turn, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for p, r in result["policies"].items():
        ys = r["ttft_mean_by_turn_s"]
        ax.plot(range(1, len(ys) + 1), [y * 1000 for y in ys], marker="o", label=p)
    w = result["workload"]
    ax.set_xticks(range(1, w["turns"] + 1))
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("mean time to first token (ms)")
    ax.set_title(f"{w['users']} users x {w['turns']} turns on {w['replicas']} replicas")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
