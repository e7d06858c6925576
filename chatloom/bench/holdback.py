"""What the output-moderation hold-back costs: the delay it adds before text reaches the user.

One run of the model, measured both ways: each streamed piece's arrival time (what an unguarded
stream would show at once) and the time the guard releases it (what the guarded stream shows),
for the lexicon's guard (holds back only text that could start a phrase) and, on the same pieces,
for a fixed hold-back of --holdback pieces (what a moderator that cannot tell gets). The guards run
in the loop, as in the service, so their check time is included.

    python -m chatloom.bench.holdback [--model ID] [--num-prompts 8] [--max-tokens 64] [--holdback 4]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from chatloom.bench.serve import make_prompts, percentiles


async def measure(backend, prompts: list[str], max_tokens: int, holdback: int) -> dict:
    from chatloom.app.traffic.moderation import LexiconModerator, OutputGuard
    from chatloom.serving import GenerationRequest

    class _Fixed(LexiconModerator):  # the same checks, without knowing what is safe
        def safe_prefix(self, text: str, cuts=None) -> None:
            return None

    delays = {"partial": ([], [], []), "fixed": ([], [], [])}  # first delay, piece delays, check us
    for i, prompt in enumerate(prompts):
        guards = {"partial": OutputGuard(LexiconModerator(), holdback), "fixed": OutputGuard(_Fixed(), holdback)}
        arrivals: list[float] = []
        shown: dict[str, list[float]] = {"partial": [], "fixed": []}
        request = GenerationRequest(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                    temperature=0.0, request_id=f"holdback-{i}")
        async for delta in backend.stream(request):
            if delta.text:
                arrivals.append(time.perf_counter())
                for name, guard in guards.items():
                    t0 = time.perf_counter()
                    released = await guard.push(delta.text)
                    now = time.perf_counter()
                    delays[name][2].append((now - t0) * 1e6)
                    shown[name] += [now] * len(released)
            if delta.finished:
                for name, guard in guards.items():
                    shown[name] += [time.perf_counter()] * len(await guard.finish())
        for name in guards:
            if arrivals and shown[name]:
                delays[name][0].append(shown[name][0] - arrivals[0])
                delays[name][1].extend(s - a for a, s in zip(arrivals, shown[name]))
    return {"benchmark": "moderation_holdback", "holdback_tokens": holdback, "num_prompts": len(prompts),
            "max_tokens": max_tokens,
            **{name: {"added_ttft_ms": percentiles(first), "added_delay_per_piece_ms": percentiles(pieces),
                      "check_us_per_piece": {"mean": round(statistics.fmean(us), 2),
                                             "p99": round(sorted(us)[int(0.99 * (len(us) - 1))], 2)}}
               for name, (first, pieces, us) in delays.items()}}


async def _main(args: argparse.Namespace) -> dict:
    from chatloom.engine import EngineConfig
    from chatloom.serving import LocalBackend

    backend = LocalBackend(args.model, engine_config=EngineConfig(kv_cache_gb=0.25))
    await backend.start()
    try:
        # One warm-up request so the first measured one does not pay for lazy initialisation.
        await measure(backend, make_prompts(1, seed=99), 8, args.holdback)
        result = await measure(backend, make_prompts(args.num_prompts, args.seed), args.max_tokens, args.holdback)
        return {**result, "model": backend.default_model}
    finally:
        await backend.close()


def main(argv: list[str] | None = None) -> None:
    from chatloom.models.registry import DEFAULT_MODEL

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--holdback", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    print(json.dumps(asyncio.run(_main(p.parse_args(argv))), indent=2))


if __name__ == "__main__":
    main()
