"""`chatloom bench ...`: each benchmark prints JSON (and a table with --table)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from chatloom.bench.workload import OFFLINE_TOKEN_BUDGET
from chatloom.argtypes import positive_int
from chatloom.model_args import add_model_args, load_from_args


def _common(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", action="store_true", help="also print a human-readable table")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` command and its subcommands to the top-level parser."""
    bench = subparsers.add_parser("bench", help="benchmarks that print JSON")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    p = sub.add_parser("throughput", help="offline throughput: continuous vs static vs sequential")
    _common(p)
    p.add_argument("--mode", choices=["continuous", "static", "sequential"], default="continuous")
    p.add_argument("--compare", action="store_true", help="run all three modes in one process and print ratios")
    p.add_argument("--num-requests", type=positive_int, default=64)
    p.add_argument("--max-num-seqs", type=positive_int, default=64)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=OFFLINE_TOKEN_BUDGET,
                   help="continuous mode's per-step token budget (default %(default)s: an offline run has no "
                        "streams whose inter-token latency a long step would hurt; `serve` defaults to 512)")
    p.add_argument("--static-batch-size", type=positive_int, default=32)
    p.add_argument("--sequential-requests", type=positive_int, default=8,
                   help="with --compare: how many of the requests the slow sequential mode runs")
    p.add_argument("--repeats", type=positive_int, default=1, help="with --compare: rounds of all modes, interleaved")
    p.set_defaults(func=_throughput)

    p = sub.add_parser("prefix", help="multi-turn TTFT with prefix caching on and off")
    _common(p)
    p.add_argument("--turns", type=positive_int, default=8)
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.set_defaults(func=_prefix)

    p = sub.add_parser("memory", help="KV memory holding real tokens: paged vs contiguous")
    _common(p)
    p.add_argument("--num-requests", type=positive_int, default=64)
    p.set_defaults(func=_memory)

    p = sub.add_parser("roofline", help="matmul GFLOP/s at the engine's batch sizes and the engine's fraction")
    _common(p)
    p.add_argument("--num-requests", type=positive_int, default=32)
    p.set_defaults(func=_roofline)

    p = sub.add_parser("structured", help="constrained decoding: step time with JSON-schema masks vs free")
    _common(p)
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=positive_int, default=48)
    p.add_argument("--repeats", type=positive_int, default=2, help="rounds of free and masked, interleaved")
    p.set_defaults(func=_structured)

    p = sub.add_parser("serve", help="load an OpenAI-compatible server: TTFT/TPOT/ITL/latency percentiles, goodput")
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model id to request")
    p.add_argument("--num-prompts", type=positive_int, default=32)
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--request-rate", type=float, help="mean requests per second (Poisson arrivals)")
    load.add_argument("--max-concurrency", type=positive_int, help="requests in flight at once (all sent at t=0)")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY if set)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 (e2el too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", action="store_true", help="also print a human-readable table")
    p.set_defaults(func=_serve)


def _emit(result: dict, table: bool) -> int:
    print(json.dumps(result, indent=2))
    if table:
        for key, value in _flatten(result):
            print(f"{key:<48} {value}", file=sys.stderr)
    return 0


def _flatten(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        elif isinstance(v, list) and len(v) and isinstance(v[0], dict):
            for i, item in enumerate(v):
                yield from _flatten(item, f"{prefix}{k}[{i}].")
        else:
            yield f"{prefix}{k}", v


def _throughput(args) -> int:
    from chatloom.bench.throughput import run_mode
    from chatloom.models.packed_linear import uses_int8_matmul
    from chatloom.bench.workload import standard_workload

    loaded = load_from_args(args)
    requests = standard_workload(args.num_requests, loaded.config.vocab_size, args.seed,
                                 avoid_ids=set(loaded.tokenizer.eos_token_ids))
    kw = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              static_batch_size=args.static_batch_size)
    if not args.compare:
        return _emit(dict(run_mode(args.mode, loaded, requests, **kw), model=loaded.id, seed=args.seed,
                          int8_matmul=uses_int8_matmul(loaded.model)), args.table)
    runs: dict[str, list[dict]] = {"continuous": [], "static": [], "sequential": []}
    for _ in range(args.repeats):
        # Interleaved so that noise from a shared machine lands on every mode alike.
        runs["continuous"].append(run_mode("continuous", loaded, requests, **kw))
        runs["static"].append(run_mode("static", loaded, requests, **kw))
        runs["sequential"].append(run_mode("sequential", loaded, requests[: args.sequential_requests], **kw))
    rate = {m: statistics.median(r["output_tokens_per_s"] for r in rs) for m, rs in runs.items()}
    result = {
        "benchmark": "throughput", "model": loaded.id, "seed": args.seed, "num_requests": args.num_requests,
        "int8_matmul": uses_int8_matmul(loaded.model),
        "runs": [r for rs in runs.values() for r in rs],
        "output_tokens_per_s": rate,
        "continuous_vs_static": round(rate["continuous"] / rate["static"], 2),
        "continuous_vs_sequential": round(rate["continuous"] / rate["sequential"], 2),
    }
    return _emit(result, args.table)


def _prefix(args) -> int:
    from chatloom.bench.prefix import run_prefix

    return _emit(dict(run_prefix(load_from_args(args), turns=args.turns, max_tokens=args.max_tokens), model=args.model),
                 args.table)


def _memory(args) -> int:
    from chatloom.bench.memory import run_memory
    from chatloom.bench.workload import standard_workload

    loaded = load_from_args(args)
    requests = standard_workload(args.num_requests, loaded.config.vocab_size, args.seed)
    return _emit(dict(run_memory(loaded, requests), model=loaded.id, seed=args.seed), args.table)


def _roofline(args) -> int:
    from chatloom.bench.roofline import run_roofline

    return _emit(dict(run_roofline(load_from_args(args), args.num_requests, args.seed), model=args.model), args.table)


def _structured(args) -> int:
    from chatloom.bench.structured import run_structured

    return _emit(run_structured(load_from_args(args), args.batch_sizes, args.max_tokens, args.repeats, args.seed),
                 args.table)


def _serve(args) -> int:
    import asyncio
    import os

    from chatloom.bench.serve import parse_goodput, run_serve

    if args.request_rate is not None and args.request_rate <= 0:
        raise ValueError("--request-rate must be positive")
    result = asyncio.run(run_serve(args.base_url, args.model, args.num_prompts, args.request_rate,
                                   args.max_concurrency, args.api_key or os.environ.get("OPENAI_API_KEY"),
                                   args.max_tokens, parse_goodput(args.goodput), args.seed))
    return _emit(result, args.table)
