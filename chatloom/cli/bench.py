"""`chatloom bench ...`: each benchmark prints JSON (and a table with --table)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from chatloom.bench.workload import OFFLINE_TOKEN_BUDGET
from chatloom.argtypes import positive_int
from chatloom.model_args import KV_CACHE_DTYPE_NAMES, add_model_args, load_from_args
from chatloom.models.registry import DEFAULT_MODEL

# bench/perplexity.py's MODES (it imports torch; the parser is built without it; a test keeps them equal).
PERPLEXITY_MODES = ("exact", "int8", "bf16", "exact+fp16kv", "exact+bf16kv", "int8+fp32kv", "int8+bf16kv")


def _common(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--bf16-matmul", action="store_true", default=None,
                   help="keep every matmul weight in bfloat16 (AVX-512 BF16 where the CPU has it; see README; "
                        "default: $CHATLOOM_MODEL__BF16_MATMUL, else off)")
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

    p = sub.add_parser("spec", help="speculative decoding on vs off: batch 1 and 8, repeating, mixed and plain chat")
    _common(p)
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--num-prompts", type=positive_int, default=8, help="prompts per workload (at most 8)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=4)
    p.add_argument("--repeats", type=positive_int, default=1, help="rounds of on and off, alternating which goes first")
    p.add_argument("--speculative-model", default=None, metavar="ID|PATH|self-int8|self-layers:N",
                   help="also run the draft-model proposer with this draft")
    p.add_argument("--no-adaptive", action="store_true", help="always propose as many tokens as allowed")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="PyTorch intra-op threads (default: PyTorch's choice; 1 on a busy shared machine)")
    p.set_defaults(func=_spec)

    p = sub.add_parser("perplexity", help="perplexity on a shipped public-domain text, per matmul mode")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry id or path (default: %(default)s)")
    p.add_argument("--modes", nargs="+", choices=PERPLEXITY_MODES, default=["exact", "int8", "bf16"],
                   help="exact: float32 (quantized weights expanded exactly); int8: int8 activations (and its "
                        "fp16 KV cache); bf16: bfloat16 weights (default: these three). +fp16kv, +bf16kv, "
                        "+fp32kv: the same through a KV cache of that dtype")
    p.add_argument("--window", type=positive_int, default=512, help="tokens per scored window (default %(default)s)")
    p.add_argument("--text", default=None, help="another UTF-8 text file to score instead of the shipped one")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="score only the text's first N tokens")
    p.add_argument("--table", action="store_true", help="also print a human-readable table")
    p.set_defaults(func=_perplexity)

    p = sub.add_parser("attention", help="the paged-attention kernel on a decode step vs a plain read of memory")
    p.add_argument("--sequences", type=positive_int, default=32, help="sequences in the step (default %(default)s)")
    p.add_argument("--positions", type=positive_int, default=250,
                   help="cached positions of the longest sequence; the others hold up to 100 fewer (default %(default)s)")
    p.add_argument("--layers", type=positive_int, default=30, help="layers, each with its own pools (default %(default)s)")
    p.add_argument("--heads", type=positive_int, default=9, help="query heads (default: SmolLM2's %(default)s)")
    p.add_argument("--kv-heads", type=positive_int, default=3, help="KV heads (default %(default)s)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="values per head (default %(default)s)")
    p.add_argument("--kv-cache-dtype", default="fp32", choices=KV_CACHE_DTYPE_NAMES,
                   help="the pools' dtype (default %(default)s)")
    p.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    p.add_argument("--threads", type=positive_int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--table", action="store_true", help="also print a human-readable table")
    p.set_defaults(func=_attention)

    p = sub.add_parser("kquant-matmul", help="quantized matmul kernels per GGUF type vs the float32 kernel")
    p.add_argument("--kinds", nargs="+", default=["Q4_K", "Q5_K", "Q6_K"],
                   choices=["Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q8_0"])
    p.add_argument("--k", type=positive_int, default=2048, help="input features (a multiple of 256)")
    p.add_argument("--n", type=positive_int, default=2048, help="output features")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    p.add_argument("--threads", type=positive_int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--table", action="store_true", help="also print a human-readable table")
    p.set_defaults(func=_kquant_matmul)

    p = sub.add_parser("latency", help="batch-1 TTFT/TPOT at every layer (engine .. HTTP) and the engine step's breakdown")
    _common(p)
    p.add_argument("--prompt-tokens", type=positive_int, nargs="+", default=[32, 256, 1024],
                   help="prompt lengths to measure (default: %(default)s)")
    p.add_argument("--in-flight", type=positive_int, nargs="+", default=[1],
                   help="requests sent at once per case (default: %(default)s; e.g. 1 8)")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--repeats", type=positive_int, default=3, help="counted rounds (after one warm-up round)")
    p.add_argument("--layers", nargs="+", choices=["engine", "async", "backend", "openai", "conversations"],
                   default=None, help="layers to run (default: all; the first is the baseline)")
    p.add_argument("--breakdown-steps", type=positive_int, default=32, help="decode steps in the instrumented run")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    p.set_defaults(func=_latency)

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

    p = sub.add_parser("paired", help="one server against a baseline, requests alternated one at a time: "
                                      "TTFT/TPOT ratios with a bootstrap interval")
    p.add_argument("--url", required=True, help="the server measured, e.g. http://127.0.0.1:8000")
    p.add_argument("--baseline-url", required=True, help="the server it is compared with")
    p.add_argument("--api-key", default=None, help="the measured server's Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--baseline-api-key", default=None, help="the baseline's Bearer token (default: none)")
    p.add_argument("--model", default=None, help="model id (default: the first the server lists)")
    p.add_argument("--baseline-model", default=None, help="the baseline's model id (default: its first)")
    p.add_argument("--label", default="chatloom")
    p.add_argument("--baseline-label", default="baseline")
    p.add_argument("--rounds", type=positive_int, default=24, help="counted rounds, one request to each server")
    p.add_argument("--warmup", type=int, default=2, help="rounds sent first and not counted")
    p.add_argument("--min-tokens", type=positive_int, default=32, help="each round's max_tokens is drawn from "
                                                                          "[--min-tokens, --max-tokens]")
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--target-tpot-ratio", type=float, default=None, help="e.g. 0.8: report whether it is met")
    p.add_argument("--target-ttft-ratio", type=float, default=None, help="e.g. 1.0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", action="store_true", help="also print a human-readable table")
    p.set_defaults(func=_paired)

    p = sub.add_parser("calibrate", help="time the engine's steps by batch shape; write the simulator's step-time model")
    _common(p)
    p.add_argument("--output", default="step_time.json", help="where to write the model JSON (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    p.add_argument("--rounds", type=positive_int, default=1, help="passes over the calibration phases")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("router", help="multi-turn chat over N local replicas, once per routing policy")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry id or path (default: %(default)s)")
    p.add_argument("--replicas", type=positive_int, default=4, help="local replica processes (default 4)")
    p.add_argument("--replica-url", action="append", default=None, metavar="URL",
                   help="use these running replicas instead of starting local ones (repeat)")
    p.add_argument("--threads", type=positive_int, default=1, help="CPU threads per replica (default 1)")
    p.add_argument("--policies", default="round_robin,least_load,prefix_aware",
                   help="comma-separated policies to run, in order (default: all three)")
    p.add_argument("--users", type=positive_int, default=8, help="conversations at once (default 8)")
    p.add_argument("--turns", type=positive_int, default=8, help="turns per conversation (default 8)")
    p.add_argument("--max-tokens", type=positive_int, default=8, help="answer length (default 8)")
    p.add_argument("--system-words", type=positive_int, default=60, help="words in the shared system prompt")
    p.add_argument("--message-words", type=positive_int, default=80, help="words in each user message")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG of TTFT per turn for each policy")
    p.add_argument("--table", action="store_true", help="also print a table")
    p.set_defaults(func=_router)

    p = sub.add_parser("sim-validate", help="the real engine against the simulator at two request rates")
    _common(p)
    p.add_argument("--rates", type=float, nargs=2, default=None, metavar="RPS",
                   help="two request rates (requests/s, Poisson); default: 25%% and 60%% of what the calibrated "
                        "model says this machine sustains")
    p.add_argument("--num-prompts", type=positive_int, default=40)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--step-time", default=None, help="a step-time JSON; default: calibrate first, in the same run")
    p.set_defaults(func=_sim_validate)

    p = sub.add_parser("busy", help="one stream's TPOT quiet and beside busy-loop processes, alternated")
    _common(p)
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--prompt-tokens", type=positive_int, default=64)
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--neighbours", type=positive_int, default=1, help="busy-loop processes in the busy rounds")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    p.set_defaults(func=_busy)

    p = sub.add_parser("checkpoints", help="write random-weight checkpoints of real model shapes (Hugging Face "
                                           "folder and GGUF F16), offline")
    p.add_argument("--shapes", nargs="+", default=None, metavar="SHAPE",
                   help="smollm2-1.7b, qwen2.5-1.5b, llama3.2-3b (default: all three)")
    p.add_argument("--out", required=True, help="the folder to write NAME-hf/ and NAME-f16.gguf into")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_checkpoints)


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


def _attention(args) -> int:
    import torch

    from chatloom.bench.attention import run_attention

    if args.threads:
        torch.set_num_threads(args.threads)
    return _emit(run_attention(args.sequences, args.positions, args.layers, args.heads, args.kv_heads, args.head_dim,
                               args.kv_cache_dtype, args.seconds), args.table)


def _kquant_matmul(args) -> int:
    import torch

    from chatloom.bench.kquant_matmul import run_kquant_matmul

    if args.threads:
        torch.set_num_threads(args.threads)
    return _emit(run_kquant_matmul(args.kinds, args.k, args.n, args.rows, args.seconds), args.table)


def _perplexity(args) -> int:
    from pathlib import Path

    from chatloom.bench.perplexity import TEXT, run_perplexity

    text = Path(args.text) if args.text else TEXT
    if not text.is_file():
        raise ValueError(f"text file not found: {text}")
    return _emit(run_perplexity(args.model, args.modes, args.window, text, args.max_tokens), args.table)


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


def _spec(args) -> int:
    import torch

    from chatloom.bench.spec import run_spec

    if args.threads:
        torch.set_num_threads(args.threads)
    return _emit(run_spec(load_from_args(args), tuple(args.batch_sizes), args.max_tokens, args.num_prompts,
                          args.repeats, args.num_speculative_tokens, args.speculative_model,
                          not args.no_adaptive), args.table)

def _structured(args) -> int:
    from chatloom.bench.structured import run_structured

    return _emit(run_structured(load_from_args(args), args.batch_sizes, args.max_tokens, args.repeats, args.seed),
                 args.table)


def _latency(args) -> int:
    import torch

    from chatloom.bench.latency import format_table, run_latency

    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_latency(load_from_args(args), args.prompt_tokens, args.in_flight, args.repeats, args.max_tokens,
                         args.layers, args.breakdown_steps)
    print(json.dumps(result, indent=2))
    if args.table:
        print(format_table(result), file=sys.stderr)
    return 0


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


def _paired(args) -> int:
    import asyncio
    import os

    from chatloom.bench.paired import Server, format_table, run_paired

    if args.warmup < 0:
        raise ValueError("--warmup must be 0 or more")
    for name in ("target_tpot_ratio", "target_ttft_ratio"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.label == args.baseline_label:
        raise ValueError("--label and --baseline-label must differ")
    candidate = Server(args.label, args.url, args.model, args.api_key or os.environ.get("OPENAI_API_KEY"))
    baseline = Server(args.baseline_label, args.baseline_url, args.baseline_model, args.baseline_api_key)
    result = asyncio.run(run_paired(candidate, baseline, args.rounds, args.min_tokens, args.max_tokens, args.warmup,
                                    args.seed, args.target_tpot_ratio, args.target_ttft_ratio))
    print(json.dumps(result, indent=2))
    if args.table:
        print(format_table(result), file=sys.stderr)
    return 0


def _calibrate(args) -> int:
    from chatloom.bench.calibrate import run_calibrate

    model, summary = run_calibrate(load_from_args(args), args.seed, args.max_num_batched_tokens, rounds=args.rounds)
    model.save(args.output)
    summary["output"] = args.output
    return _emit(summary, args.table)


def _sim_validate(args) -> int:
    from chatloom.bench.sim_validate import run_sim_validate

    if args.rates and any(r <= 0 for r in args.rates):
        raise ValueError("--rates must be positive")
    return _emit(run_sim_validate(load_from_args(args), args.rates, args.num_prompts, args.max_tokens, args.seed,
                                  args.step_time), args.table)

def _busy(args) -> int:
    import torch

    from chatloom.bench.busy import run_busy

    if args.threads:
        torch.set_num_threads(args.threads)
    return _emit(run_busy(load_from_args(args), args.rounds, args.prompt_tokens, args.max_tokens, args.neighbours,
                          args.seed), args.table)


def _checkpoints(args) -> int:
    from pathlib import Path

    from chatloom.bench.checkpoints import SHAPES, make_checkpoint

    names = args.shapes or list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise ValueError(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    written = {}
    for name in names:
        print(f"writing {name} under {args.out}", file=sys.stderr)
        made = make_checkpoint(SHAPES[name], Path(args.out), args.seed)
        written[name] = {"hf_folder": str(made.hf_folder), "gguf_f16": str(made.gguf_file),
                         "parameters": made.parameters, "gguf_bytes": made.gguf_file.stat().st_size}
    print(json.dumps({"benchmark": "checkpoints", "seed": args.seed, "checkpoints": written}, indent=2))
    return 0


def _router(args) -> int:
    from chatloom.bench.router_policies import plot, run_router_bench, table
    from chatloom.serving.local_fleet import LocalReplicas
    from chatloom.serving.policies import POLICIES

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"--policies: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(POLICIES)}")
    local = None
    urls = args.replica_url
    if not urls:
        local = LocalReplicas(args.model, args.replicas, args.threads)
        print(f"starting {args.replicas} replicas of {args.model} ({args.threads} thread(s) each)", file=sys.stderr)
        try:
            urls = local.start()
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
    try:
        result = run_router_bench(args.model, urls, policies, args.users, args.turns, args.max_tokens, args.seed,
                                  args.system_words, args.message_words)
    finally:
        if local is not None:
            local.stop()
    result["model"] = args.model
    result["threads_per_replica"] = args.threads
    print(json.dumps(result, indent=2))
    if args.table:
        print(table(result), file=sys.stderr)
    if args.plot:
        plot(result, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
