"""`chatloom bench paired`: one server against a baseline, one request at a time, alternated.

On a small shared machine a server's single-stream pace moves by 10-30% from one minute to the next
(neighbours, the host), so timing one server for a while and then the other compares two different
minutes as much as two servers. Here every round sends the same prompt to both, one after the other,
in ABBA order (candidate first in even rounds, the baseline first in odd ones), so what drifts within
a round falls on both. The comparison is per round (candidate over baseline, for the TPOT and the
TTFT) and over the run (the ratio of the two p50s), with a bootstrap interval over rounds: the range
the ratio of p50s takes when the rounds are resampled, which says how much of a difference the run
can tell from noise.

Requests are streamed /v1/chat/completions calls, greedy, with metrics as in `bench serve` (TPOT =
(latency - TTFT) / (output tokens - 1)).
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import httpx

from chatloom.bench.serve import Result, make_prompts, one_request

BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class Server:
    label: str
    base_url: str
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class Round:
    prompt: str
    max_tokens: int
    candidate_first: bool
    candidate: Result
    baseline: Result

    @property
    def ok(self) -> bool:
        return (self.candidate.ok and self.baseline.ok and self.candidate.tpot is not None
                and self.baseline.tpot is not None)


async def _model_of(client: httpx.AsyncClient, server: Server) -> str:
    if server.model:
        return server.model
    url = server.base_url.rstrip("/") + "/v1/models"
    try:
        r = await client.get(url, headers=server.headers)
    except httpx.HTTPError as exc:
        raise ValueError(f"{server.label}: cannot reach {url}: {exc or type(exc).__name__}") from None
    if r.status_code != 200:
        raise ValueError(f"{server.label}: GET /v1/models answered {r.status_code}; pass its model id")
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{server.label}: /v1/models lists no model; pass its model id")
    return data[0]["id"]


def median_ratio_interval(pairs: list[tuple[float, float]], samples: int = BOOTSTRAP_SAMPLES,
                          seed: int = 0) -> tuple[float, float]:
    """2.5th and 97.5th percentiles of median(a) / median(b) over rounds resampled with replacement."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(samples):
        draw = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        ratios.append(statistics.median(a for a, _ in draw) / statistics.median(b for _, b in draw))
    ratios.sort()
    return ratios[int(0.025 * (samples - 1))], ratios[int(0.975 * (samples - 1))]


def _request(r: Result) -> dict:
    if not r.ok:
        return {"ok": False, "status": r.status}
    return {"ok": True, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
            "ttft_ms": round(r.ttft * 1000, 2), "tpot_ms": round(r.tpot * 1000, 3) if r.tpot is not None else None}


def _side(results: list[Result]) -> dict:
    done = [r for r in results if r.ok]
    tpots = [r.tpot for r in done if r.tpot is not None]
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "output_tokens": sum(r.output_tokens for r in done),
        "ttft_p50_ms": round(statistics.median(r.ttft for r in done) * 1000, 2) if done else None,
        "tpot_p50_ms": round(statistics.median(tpots) * 1000, 3) if tpots else None,
        "tpot_mean_ms": round(statistics.fmean(tpots) * 1000, 3) if tpots else None,
        "sample_errors": [f"{r.status}: {r.error}" for r in results if not r.ok][:3],
    }


def summarize(rounds: list[Round], candidate: str, baseline: str, target_tpot_ratio: float | None = None,
              target_ttft_ratio: float | None = None, seed: int = 0) -> dict:
    """The run's figures from its rounds (JSON-ready). Ratios use only rounds where both requests worked."""
    ok = [r for r in rounds if r.ok]
    out: dict = {
        "rounds": len(rounds), "rounds_compared": len(ok),
        "candidate": {"label": candidate, **_side([r.candidate for r in rounds])},
        "baseline": {"label": baseline, **_side([r.baseline for r in rounds])},
        "same_output_tokens_rounds": sum(1 for r in ok if r.candidate.output_tokens == r.baseline.output_tokens),
        "per_round": [{"max_tokens": r.max_tokens, "candidate_first": r.candidate_first,
                       "candidate": _request(r.candidate), "baseline": _request(r.baseline)} for r in rounds],
    }
    if len(ok) < 2:
        out["note"] = "fewer than two rounds where both servers answered: no ratios"
        return out
    for metric, target in (("tpot", target_tpot_ratio), ("ttft", target_ttft_ratio)):
        def value(res: Result) -> float:
            return res.tpot if metric == "tpot" else res.ttft  # type: ignore[return-value]
        pairs = [(value(r.candidate), value(r.baseline)) for r in ok]
        if any(b <= 0 for _, b in pairs):
            continue
        per_round = sorted(a / b for a, b in pairs)
        ratio = statistics.median(a for a, _ in pairs) / statistics.median(b for _, b in pairs)
        low, high = median_ratio_interval(pairs, seed=seed)
        figures = {
            "p50_ratio": round(ratio, 3),
            "p50_ratio_ci95": [round(low, 3), round(high, 3)],
            "per_round_median": round(statistics.median(per_round), 3),
            "per_round_min_max": [round(per_round[0], 3), round(per_round[-1], 3)],
        }
        if target is not None:
            figures.update({
                "target": target,
                "meets_target": ratio <= target,
                "meets_target_at_ci95": high <= target,  # even the interval's worst end is within it
                "rounds_within_target": sum(1 for x in per_round if x <= target),
            })
        out[f"{metric}_ratio"] = figures
    return out


async def run_paired(candidate: Server, baseline: Server, rounds: int, min_tokens: int = 32,
                     max_tokens: int = 256, warmup: int = 2, seed: int = 0,
                     target_tpot_ratio: float | None = None, target_ttft_ratio: float | None = None,
                     timeout_s: float = 600.0) -> dict:
    """Alternate the two servers for `rounds` rounds (after `warmup` unrecorded ones) and summarize."""
    if rounds < 2:
        raise ValueError("--rounds must be at least 2 (one of each order)")
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError("--min-tokens must be at least 1 and at most --max-tokens")
    rng = random.Random(seed)
    prompts = make_prompts(warmup + rounds, seed)
    budgets = [rng.randint(min_tokens, max_tokens) for _ in prompts]
    # One client per server: each keeps its own connection alive, as a chat client would.
    async with httpx.AsyncClient(timeout=timeout_s) as c_client, httpx.AsyncClient(timeout=timeout_s) as b_client:
        models = {candidate.label: await _model_of(c_client, candidate),
                  baseline.label: await _model_of(b_client, baseline)}

        async def ask(server: Server, client: httpx.AsyncClient, prompt: str, n: int) -> Result:
            url = server.base_url.rstrip("/") + "/v1/chat/completions"
            return await one_request(client, url, server.headers, models[server.label], prompt, n)

        done: list[Round] = []
        for i, (prompt, n) in enumerate(zip(prompts, budgets)):
            candidate_first = i % 2 == 0
            if candidate_first:
                c = await ask(candidate, c_client, prompt, n)
                b = await ask(baseline, b_client, prompt, n)
            else:
                b = await ask(baseline, b_client, prompt, n)
                c = await ask(candidate, c_client, prompt, n)
            if i >= warmup:
                done.append(Round(prompt, n, candidate_first, c, b))
    result = {"benchmark": "paired", "candidate_url": candidate.base_url, "baseline_url": baseline.base_url,
              "models": models, "min_tokens": min_tokens, "max_tokens": max_tokens, "warmup": warmup,
              "seed": seed}
    result.update(summarize(done, candidate.label, baseline.label, target_tpot_ratio, target_ttft_ratio, seed))
    return result


def format_table(result: dict) -> str:
    c, b = result["candidate"], result["baseline"]
    lines = [f"{'server':<14}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}{'tokens':>8}{'failed':>8}"]
    for side in (c, b):
        lines.append(f"{side['label']:<14}{side['ttft_p50_ms'] or '-':>13}{side['tpot_p50_ms'] or '-':>13}"
                     f"{side['output_tokens']:>8}{side['failed']:>8}")
    for metric in ("tpot", "ttft"):
        f = result.get(f"{metric}_ratio")
        if f:
            line = (f"{metric.upper()} {c['label']}/{b['label']}: p50 ratio {f['p50_ratio']} "
                    f"(95% interval {f['p50_ratio_ci95'][0]}-{f['p50_ratio_ci95'][1]}), per round median "
                    f"{f['per_round_median']}, range {f['per_round_min_max'][0]}-{f['per_round_min_max'][1]}")
            if "target" in f:
                line += (f"; target {f['target']}: {'met' if f['meets_target'] else 'not met'}"
                         f"{' (also at the interval end)' if f['meets_target_at_ci95'] else ''}, "
                         f"{f['rounds_within_target']}/{result['rounds_compared']} rounds within it")
            lines.append(line)
    return "\n".join(lines)

