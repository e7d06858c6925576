"""`chatloom bench tools`: the KV cache during a tool call, hold vs evict vs auto, beside bystander chat.

Each run starts a fresh engine (through LocalBackend, the path the chat's tool loop takes) and runs, for
the same seeded workload:

- tool answers: a long prompt, a first round that ends "in a tool call", a scripted tool that sleeps a
  seeded duration (0.2-5 s by default), then the resume (prompt + round + tool result) naming its round;
  what is measured is the resume's time to first token after the tool result;
- bystanders: users sending chat requests back to back the whole time: their TTFT p90 and tokens per
  second;
- the KV occupancy, sampled every SAMPLE_S: its mean and peak.

The policies run once per round in an order that rotates between rounds (the machine may be shared),
under a light configuration (a roomy pool) and a memory-tight one (a pool of few blocks). `auto` is
compared with the better of hold and evict on each figure.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, replace

from chatloom.engine import EngineConfig
from chatloom.models import LoadedModel
from chatloom.serving.backend import GenerationRequest
from chatloom.serving.local import LocalBackend

POLICIES = ("hold", "evict", "auto")
SAMPLE_S = 0.02
# Figures compared across policies: name -> True when higher is better.
FIGURES = {"resume_ttft_mean_s": False, "resume_ttft_p90_s": False, "bystander_ttft_p90_s": False,
           "bystander_tokens_per_s": True, "kv_occupancy_mean": False, "kv_occupancy_peak": False}


@dataclass(frozen=True)
class Workload:
    tool_answers: int = 8
    stagger_s: float = 0.6  # between the starts of two tool answers
    tool_s: tuple[float, float] = (0.2, 5.0)
    prompt_words: int = 150
    tool_result_words: int = 30
    round_tokens: int = 16
    resume_tokens: int = 8
    bystanders: int = 2
    bystander_words: int = 30
    bystander_tokens: int = 8
    seed: int = 0


QUICK = Workload(tool_answers=2, stagger_s=0.05, tool_s=(0.05, 0.15), prompt_words=15, tool_result_words=4,
                 round_tokens=4, resume_tokens=3, bystanders=1, bystander_words=8, bystander_tokens=3)


def _words(rng: random.Random, n: int) -> str:
    vocab = ["kernel", "cache", "ledger", "orbit", "harbor", "lantern", "meadow", "quartz", "signal", "timber",
             "violet", "walnut", "beacon", "canyon", "delta", "ember", "falcon", "glacier", "island", "jasmine"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def _p90(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


async def _ttft_stream(backend: LocalBackend, req: GenerationRequest) -> tuple[float | None, str, int]:
    """(seconds to the first text, the whole text, completion tokens)."""
    start, first, parts, tokens = time.perf_counter(), None, [], 0
    async for delta in backend.stream(req):
        if first is None and (delta.text or delta.token_ids):
            first = time.perf_counter() - start
        parts.append(delta.text)
        if delta.finished:
            tokens = delta.completion_tokens
    return first, "".join(parts), tokens


async def _one_run(loaded: LoadedModel, config: EngineConfig, policy: str, w: Workload) -> dict:
    backend = LocalBackend(loaded, engine_config=config)
    await backend.start()
    engine = backend.engine
    rng = random.Random(w.seed)
    system = _words(rng, w.prompt_words)
    answers = [(f"Question {i}: {_words(rng, 12)}", rng.uniform(*w.tool_s), _words(rng, w.tool_result_words))
               for i in range(w.tool_answers)]
    resume_ttft: list[float] = []
    by_ttft: list[float] = []
    by_tokens = 0
    samples: list[float] = []
    done = asyncio.Event()

    async def tool_answer(i: int) -> None:
        question, tool_s, result = answers[i]
        await asyncio.sleep(i * w.stagger_s)
        msgs = [{"role": "system", "content": f"Tool user {i}. {system}"}, {"role": "user", "content": question}]
        round_id = f"{policy}-tool-{i}-0"
        _, text, _ = await _ttft_stream(backend, GenerationRequest(
            messages=msgs, max_tokens=w.round_tokens, temperature=0, request_id=round_id,
            keep_kv=True))
        backend.hold_kv(round_id, ["sleep"], policy, 60.0)
        await asyncio.sleep(tool_s)  # the scripted tool
        resumed = msgs + [{"role": "assistant", "content": text}, {"role": "tool", "content": result}]
        ttft, _, _ = await _ttft_stream(backend, GenerationRequest(
            messages=resumed, max_tokens=w.resume_tokens, temperature=0, request_id=f"{policy}-tool-{i}-1",
            resume_of=round_id))
        if ttft is not None:
            resume_ttft.append(ttft)

    async def bystander(b: int) -> None:
        nonlocal by_tokens
        brng = random.Random(w.seed * 1000 + b)
        n = 0
        while not done.is_set():
            msgs = [{"role": "user", "content": f"Bystander {b} asks {n}: {_words(brng, w.bystander_words)}"}]
            ttft, _, tokens = await _ttft_stream(backend, GenerationRequest(
                messages=msgs, max_tokens=w.bystander_tokens, temperature=0, request_id=f"{policy}-by-{b}-{n}"))
            if ttft is not None:
                by_ttft.append(ttft)
            by_tokens += tokens
            n += 1

    async def sampler() -> None:
        while not done.is_set():
            samples.append(engine.snapshot().kv_cache_usage_perc)
            await asyncio.sleep(SAMPLE_S)

    started = time.perf_counter()
    background = [asyncio.create_task(bystander(b)) for b in range(w.bystanders)] + [asyncio.create_task(sampler())]
    try:
        await asyncio.gather(*(tool_answer(i) for i in range(w.tool_answers)))
        elapsed = time.perf_counter() - started
        done.set()
        await asyncio.gather(*background)
        holds = engine.snapshot().kv_holds
    finally:
        done.set()
        await backend.close()
    return {"resume_ttft": resume_ttft, "bystander_ttft": by_ttft, "bystander_tokens": by_tokens,
            "seconds": elapsed, "kv_samples": samples,
            "counters": {"holds": holds.holds, "evictions": holds.evictions,
                         "pressure_releases": holds.pressure_releases, "reprefilled_tokens": holds.reprefilled_tokens,
                         "block_seconds": holds.block_seconds}}


def figures(runs: list[dict]) -> dict:
    """The figures of one policy over its runs, their samples pooled (the p90 of every resume, not a mean
    of per-run p90s), with the hold counters summed."""
    resume = [x for r in runs for x in r["resume_ttft"]]
    by_ttft = [x for r in runs for x in r["bystander_ttft"]]
    samples = [x for r in runs for x in r["kv_samples"]]
    seconds = sum(r["seconds"] for r in runs)
    out: dict = {
        "resume_ttft_mean_s": statistics.fmean(resume) if resume else None,
        "resume_ttft_p90_s": _p90(resume),
        "bystander_ttft_p90_s": _p90(by_ttft),
        "bystander_tokens_per_s": sum(r["bystander_tokens"] for r in runs) / seconds if seconds > 0 else 0.0,
        "kv_occupancy_mean": statistics.fmean(samples) if samples else 0.0,
        "kv_occupancy_peak": max(samples, default=0.0),
    }
    out = {k: None if v is None else round(v, 4) for k, v in out.items()}
    out["bystander_requests"] = len(by_ttft)
    for counter in runs[0]["counters"]:
        out[counter] = round(sum(r["counters"][counter] for r in runs), 2)
    out["seconds"] = round(seconds, 2)
    return out


def compare(policies: dict[str, dict], margin: float = 0.10) -> dict:
    """For each figure: the better of hold and evict, auto's value, and whether auto is within `margin`."""
    out = {}
    for figure, higher in FIGURES.items():
        hold, evict, auto = (policies[p][figure] for p in POLICIES)
        if None in (hold, evict, auto):
            out[figure] = {"best": None, "auto": auto, "within": None}
            continue
        best = max(hold, evict) if higher else min(hold, evict)
        within = auto >= best * (1 - margin) if higher else auto <= best * (1 + margin)
        out[figure] = {"best": best, "auto": auto, "within": bool(within)}
    return out


def spread(per_round: dict[str, list[dict]]) -> dict:
    """For each figure, how far one policy's rounds differ from each other on this machine: the largest
    (max - min) / mean over the policies, or None with fewer than two rounds. Under the same choices and
    load this would be 0; a difference between policies smaller than it is noise."""
    out = {}
    for figure in FIGURES:
        spreads = []
        for rounds in per_round.values():
            values = [r[figure] for r in rounds if r[figure] is not None]
            if len(values) > 1 and statistics.fmean(values) > 0:
                spreads.append((max(values) - min(values)) / statistics.fmean(values))
        out[figure] = round(max(spreads), 3) if spreads else None
    return out


async def run_tools_bench(loaded: LoadedModel, configs: dict[str, EngineConfig], workload: Workload,
                          rounds: int = 1) -> dict:
    result: dict = {"workload": {**workload.__dict__, "tool_s": list(workload.tool_s)}, "rounds": rounds,
                    "configs": {}}
    # Unmeasured: the first engine of the process pays for warming up (allocation, kernels, caches).
    await _one_run(loaded, next(iter(configs.values())), "evict", replace(workload, tool_answers=1, bystanders=0,
                                                                          tool_s=(0.01, 0.01)))
    for name, config in configs.items():
        runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
        for r in range(rounds):  # every policy once per round, the order rotating: each sees the same load
            order = POLICIES[r % 3:] + POLICIES[:r % 3]
            for policy in order:
                runs[policy].append(await _one_run(loaded, config, policy, workload))
        policies = {p: figures(v) for p, v in runs.items()}
        per_round = {p: [{k: v for k, v in figures([run]).items() if k in FIGURES} for run in v]
                     for p, v in runs.items()}
        result["configs"][name] = {"num_blocks": config.num_blocks, "block_size": config.block_size,
                                   "policies": policies, "auto_vs_best": compare(policies), "per_round": per_round,
                                   "round_spread": spread(per_round)}
    return result


def table(result: dict) -> str:
    lines = []
    for name, c in result["configs"].items():
        lines.append(f"{name} ({c['num_blocks']} blocks of {c['block_size']})")
        lines.append(f"{'figure':<24}" + "".join(f"{p:>12}" for p in POLICIES) + f"{'auto ok':>10}"
                     + f"{'rounds differ':>15}")
        for figure in FIGURES:
            vals = [c["policies"][p][figure] for p in POLICIES]
            ok, noise = c["auto_vs_best"][figure]["within"], c["round_spread"][figure]
            lines.append(f"{figure:<24}" + "".join(f"{v:>12.4f}" if v is not None else f"{'-':>12}" for v in vals)
                         + f"{'yes' if ok else 'no' if ok is not None else '-':>10}"
                         + (f"{noise:>14.0%}" if noise is not None else f"{'-':>15}"))
        for counter in ("holds", "evictions", "pressure_releases", "reprefilled_tokens", "block_seconds"):
            lines.append(f"{counter:<24}" + "".join(f"{c['policies'][p][counter]:>12}" for p in POLICIES))
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """One panel per figure: each policy's value, light and tight side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(result["configs"])
    figures = list(FIGURES)
    fig, axes = plt.subplots(1, len(figures), figsize=(3.2 * len(figures), 3.4))
    width = 0.8 / len(POLICIES)
    for ax, figure in zip(axes, figures):
        for k, p in enumerate(POLICIES):
            ys = [result["configs"][c]["policies"][p][figure] or 0 for c in configs]
            ax.bar([i + k * width for i in range(len(configs))], ys, width, label=p)
        ax.set_xticks([i + width for i in range(len(configs))])
        ax.set_xticklabels(configs)
        ax.set_title(figure, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
