"""The handlers of `chatloom bench ...`: each runs one benchmark and prints its JSON (or a table)."""
from __future__ import annotations

import json
import statistics
import sys

from chatloom.model_args import load_from_args


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


def throughput(args) -> int:
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


def attention(args) -> int:
    import torch

    from chatloom.bench.attention import run_attention

    if args.threads:
        torch.set_num_threads(args.threads)
    return _emit(run_attention(args.sequences, args.positions, args.layers, args.heads, args.kv_heads, args.head_dim,
                               args.kv_cache_dtype, args.seconds), args.table)


def kquant_matmul(args) -> int:
    import torch

    from chatloom.bench.kquant_matmul import run_kquant_matmul

    if args.threads:
        torch.set_num_threads(args.threads)
    return _emit(run_kquant_matmul(args.kinds, args.k, args.n, args.rows, args.seconds, args.layers, args.cpu_time),
                 args.table)


def perplexity(args) -> int:
    from pathlib import Path

    from chatloom.bench.perplexity import TEXT, run_perplexity

    text = Path(args.text) if args.text else TEXT
    if not text.is_file():
        raise ValueError(f"text file not found: {text}")
    return _emit(run_perplexity(args.model, args.modes, args.window, text, args.max_tokens), args.table)


def prefix(args) -> int:
    from chatloom.bench.prefix import run_prefix

    return _emit(dict(run_prefix(load_from_args(args), turns=args.turns, max_tokens=args.max_tokens), model=args.model),
                 args.table)


def vision(args) -> int:
    from chatloom.bench.vision import run_vision

    loaded = load_from_args(args)
    if loaded.vision is None:
        print(f"chatloom: error: bench vision: model {loaded.id} does not take images (give a SmolVLM folder)",
              file=sys.stderr)
        return 2
    from chatloom.engine import EngineConfig

    config = EngineConfig(encoder_max_slowdown=args.encoder_max_slowdown) \
        if args.encoder_max_slowdown is not None else None
    return _emit(run_vision(loaded, rounds=args.rounds, streams=args.streams, max_tokens=args.max_tokens,
                            image_every=args.image_every, seed=args.seed, config=config), args.table)


def memory(args) -> int:
    from chatloom.bench.memory import run_memory
    from chatloom.bench.workload import standard_workload

    loaded = load_from_args(args)
    requests = standard_workload(args.num_requests, loaded.config.vocab_size, args.seed)
    return _emit(dict(run_memory(loaded, requests), model=loaded.id, seed=args.seed), args.table)


def roofline(args) -> int:
    from chatloom.bench.roofline import run_roofline

    return _emit(dict(run_roofline(load_from_args(args), args.num_requests, args.seed), model=args.model), args.table)


def spec(args) -> int:
    import torch

    from chatloom.bench.spec import run_spec

    if args.threads:
        torch.set_num_threads(args.threads)
    return _emit(run_spec(load_from_args(args), tuple(args.batch_sizes), args.max_tokens, args.num_prompts,
                          args.repeats, args.num_speculative_tokens, args.speculative_model,
                          not args.no_adaptive), args.table)

def structured(args) -> int:
    from chatloom.bench.structured import run_structured

    return _emit(run_structured(load_from_args(args), args.batch_sizes, args.max_tokens, args.repeats, args.seed),
                 args.table)


def latency(args) -> int:
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


def batch(args) -> int:
    from chatloom.bench.batch import format_table, run_batch_bench
    from chatloom.engine import EngineConfig

    config = EngineConfig(max_num_seqs=args.max_num_seqs, background_interrupt=not args.no_background_interrupt,
                          **({"num_blocks": args.num_blocks} if args.num_blocks else {}))
    result = run_batch_bench(load_from_args(args), args.requests, args.users, args.turns, args.max_tokens,
                             args.batch_max_tokens, args.think_s, args.seed, config,
                             settings={"batch": {"busy_slots": args.busy_slots}} if args.busy_slots else None,
                             rounds=args.rounds)
    print(json.dumps(result, indent=2))
    if args.table:
        print(format_table(result), file=sys.stderr)
    return 0


def serve(args) -> int:
    import asyncio
    import os

    from chatloom.bench.serve import parse_goodput, run_serve

    if args.request_rate is not None and args.request_rate <= 0:
        raise ValueError("--request-rate must be positive")
    result = asyncio.run(run_serve(args.base_url, args.model, args.num_prompts, args.request_rate,
                                   args.max_concurrency, args.api_key or os.environ.get("OPENAI_API_KEY"),
                                   args.max_tokens, parse_goodput(args.goodput), args.seed))
    return _emit(result, args.table)


def streams(args) -> int:
    from chatloom.bench.streams import StreamsConfig, format_table, run_streams

    if not 0 < args.interval_ms < 60_000:
        raise ValueError("--interval-ms must be above 0 and below 60000")
    config = StreamsConfig(streams=20 if args.quick else args.streams, tokens=10 if args.quick else args.tokens,
                           interval_ms=args.interval_ms, direct=not args.no_direct, seed=args.seed,
                           moderation=args.moderation)
    result = run_streams(config)
    print(json.dumps(result, indent=2))
    if args.table:
        print(format_table(result), file=sys.stderr)
    return 0


def chaos(args) -> int:
    from pathlib import Path

    from chatloom.bench.chaos.report import table
    from chatloom.bench.chaos.run import ChaosConfig, run_chaos

    if args.keep and Path(args.keep).exists() and any(Path(args.keep).iterdir()):
        raise ValueError(f"--keep {args.keep}: the folder must be new or empty")
    config = ChaosConfig(minutes=args.minutes, seed=args.seed, short=args.short, workdir=args.keep,
                         keep=bool(args.keep))
    result = run_chaos(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    print(table(result), file=sys.stderr)
    return 0 if result["ok"] else 1


def paired(args) -> int:
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


def calibrate(args) -> int:
    from chatloom.bench.calibrate import run_calibrate

    model, summary = run_calibrate(load_from_args(args), args.seed, args.max_num_batched_tokens, rounds=args.rounds)
    model.save(args.output)
    summary["output"] = args.output
    return _emit(summary, args.table)


def sim_validate(args) -> int:
    from chatloom.bench.sim_validate import run_sim_validate

    if args.rates and any(r <= 0 for r in args.rates):
        raise ValueError("--rates must be positive")
    return _emit(run_sim_validate(load_from_args(args), args.rates, args.num_prompts, args.max_tokens, args.seed,
                                  args.step_time), args.table)

def busy(args) -> int:
    import torch

    from chatloom.bench.busy import run_busy

    if args.threads:
        torch.set_num_threads(args.threads)
    return _emit(run_busy(load_from_args(args), args.rounds, args.prompt_tokens, args.max_tokens, args.neighbours,
                          args.seed), args.table)


def checkpoints(args) -> int:
    from pathlib import Path

    from chatloom.bench import vision_checkpoint
    from chatloom.bench.checkpoints import SHAPES, make_checkpoint
    from chatloom.bench.kquant_checkpoints import write_random_q4_k_m

    names = args.shapes or list(SHAPES)
    known = [*SHAPES, vision_checkpoint.NAME]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    written: dict[str, dict] = {}
    for name in names:
        print(f"writing {name} under {args.out}", file=sys.stderr)
        if name == vision_checkpoint.NAME:  # a Hugging Face folder only: GGUF splits a vision model in two
            if args.random_q4_k_m:
                raise ValueError(f"--random-q4-k-m: {name} is a vision model, written as a Hugging Face folder only")
            folder, params = vision_checkpoint.make_vision_checkpoint(Path(args.out), args.seed)
            written[name] = {"hf_folder": str(folder), "parameters": params}
            continue
        if args.random_q4_k_m:
            file = Path(args.out) / f"{name}-q4_k_m-random.gguf"
            written[name] = {"gguf_q4_k_m_random": str(file),
                             "gguf_bytes": write_random_q4_k_m(SHAPES[name], file, args.seed)}
            continue
        made = make_checkpoint(SHAPES[name], Path(args.out), args.seed)
        written[name] = {"hf_folder": str(made.hf_folder), "gguf_f16": str(made.gguf_file),
                         "parameters": made.parameters, "gguf_bytes": made.gguf_file.stat().st_size}
    print(json.dumps({"benchmark": "checkpoints", "seed": args.seed, "checkpoints": written}, indent=2))
    return 0


def sizes(args) -> int:
    import dataclasses
    from pathlib import Path

    from chatloom.bench.sizes import QUICK, SizesPlan, Target, format_table, run_sizes

    folders = args.hf_folder or []
    if len(folders) > len(args.model):
        raise ValueError("--hf-folder: more folders than --model files")
    targets = [Target(Path(m), Path(folders[i]) if i < len(folders) else None) for i, m in enumerate(args.model)]
    plan = QUICK if args.quick else SizesPlan()
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError("--max-tokens must be at least 2 (a TPOT needs two tokens)")
    if args.history is not None and args.history[0] > args.history[1]:
        raise ValueError("--history: MIN must not exceed MAX")
    changes = {"max_tokens": args.max_tokens, "long_prompt": args.long_prompt, "chat_requests": args.chat_requests,
               "history": tuple(args.history) if args.history else None, "tpot_requests": args.tpot_requests,
               "phases": tuple(x.strip() for x in args.phases.split(",") if x.strip()) if args.phases else None}
    plan = dataclasses.replace(plan, **{k: v for k, v in changes.items() if v is not None})
    servers = tuple(s.strip() for s in args.servers.split(",") if s.strip())
    llama_server = Path(args.llama_server) if args.llama_server else None
    log_dir = Path(args.log_dir) if args.log_dir else None
    if args.load_rounds:
        from chatloom.bench.load_time import format_load_table
        from chatloom.bench.sizes import SERVERS, load_rounds

        unknown = [s for s in servers if s not in SERVERS]
        if unknown or not targets[0].gguf.is_file():
            raise ValueError(f"unknown server {unknown[0]!r}: use {', '.join(SERVERS)}" if unknown
                             else f"no GGUF file at {targets[0].gguf}")
        result = load_rounds(targets[0], plan, servers, args.load_rounds, llama_server, args.threads, log_dir,
                             Path(args.vllm_python) if args.vllm_python else None)
        table = format_load_table
    else:
        result = run_sizes(targets, plan, servers, llama_server, args.threads, log_dir, args.seed,
                           Path(args.vllm_python) if args.vllm_python else None)
        table = format_table
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    if args.table:
        print(table(result), file=sys.stderr)
    return 0


def sizes_plot(args) -> int:
    from pathlib import Path

    from chatloom.bench.sizes_plot import models_of, plot_sizes

    results = []
    for name in args.results:
        try:
            result = json.loads(Path(name).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{name}: not a readable JSON file ({exc})") from exc
        if not isinstance(result, dict) or result.get("benchmark") != "sizes" or "models" not in result:
            raise ValueError(f"{name}: not a `chatloom bench sizes` result")
        results.append(result)
    plot_sizes(results, args.out)
    print(json.dumps({"plot": args.out, "models": [label for label, _ in models_of(results)]}))
    return 0


def router(args) -> int:
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


def tools(args) -> int:
    import asyncio
    import dataclasses

    from chatloom.bench.tools import QUICK, Workload, plot, run_tools_bench, table
    from chatloom.engine import EngineConfig

    loaded = load_from_args(args)
    w = QUICK if args.quick else Workload()
    w = dataclasses.replace(w, seed=args.seed, bystanders=args.bystanders,
                            tool_answers=min(args.tool_answers, w.tool_answers) if args.quick else args.tool_answers)
    configs = {"light": EngineConfig(num_blocks=args.light_blocks, block_size=16),
               "tight": EngineConfig(num_blocks=args.tight_blocks, block_size=16)}
    result = asyncio.run(run_tools_bench(loaded, configs, w, args.rounds))
    result["model"] = loaded.id
    print(json.dumps(result, indent=2))
    if args.table:
        print(table(result), file=sys.stderr)
    if args.plot:
        plot(result, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def retrieval(args) -> int:
    from chatloom.bench.retrieval import run_retrieval

    return _emit(run_retrieval(load_from_args(args), args.k, args.questions, args.latency_chunks,
                               chunk_chars=args.chunk_chars, overlap=args.overlap, pooling=args.pooling,
                               modes=tuple(args.modes), db_url=args.db_url, embedding_model=args.embedding_model,
                               vector_weight=args.vector_weight),
                 args.table)
