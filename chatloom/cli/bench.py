"""`chatloom bench ...`: each benchmark prints JSON (and a table with --table)."""
from __future__ import annotations

import argparse

from chatloom.bench.workload import OFFLINE_TOKEN_BUDGET
from chatloom.argtypes import positive_float, positive_int, slowdown
from chatloom.model_args import KV_CACHE_DTYPE_NAMES, add_model_args
from chatloom.models.registry import DEFAULT_MODEL
from chatloom.cli import bench_runs as runs

# chatloom/bench/sizes.py's SERVERS, named here so that building the parser does not import torch (a test
# keeps the two equal).
SIZES_SERVERS = ("chatloom", "llama-server", "vllm")

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
    p.set_defaults(func=runs.throughput)

    p = sub.add_parser("prefix", help="multi-turn TTFT with prefix caching on and off")
    _common(p)
    p.add_argument("--turns", type=positive_int, default=8)
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.set_defaults(func=runs.prefix)

    p = sub.add_parser("vision", help="a vision model: TTFT of a second question about an image, and text "
                                      "streams' inter-token p90 while images are encoded")
    _common(p)
    p.add_argument("--rounds", type=positive_int, default=4,
                   help="pairs of a quiet and a busy round, in turn quiet first and busy first (default 4)")
    p.add_argument("--streams", type=positive_int, default=4, help="text-only streams decoding together")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--image-every", type=positive_int, default=4, help="a request with a new image every N steps")
    p.add_argument("--encoder-max-slowdown", type=slowdown, default=None, metavar="F",
                   help="the encoder's share of decoding steps' time (default: [engine] encoder_max_slowdown; "
                        "inf: the step's token budget alone)")
    p.set_defaults(func=runs.vision)

    p = sub.add_parser("memory", help="KV memory holding real tokens: paged vs contiguous")
    _common(p)
    p.add_argument("--num-requests", type=positive_int, default=64)
    p.set_defaults(func=runs.memory)

    p = sub.add_parser("roofline", help="matmul GFLOP/s at the engine's batch sizes and the engine's fraction")
    _common(p)
    p.add_argument("--num-requests", type=positive_int, default=32)
    p.set_defaults(func=runs.roofline)

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
    p.set_defaults(func=runs.spec)

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
    p.set_defaults(func=runs.perplexity)

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
    p.set_defaults(func=runs.attention)

    p = sub.add_parser("kquant-matmul", help="quantized matmul kernels per GGUF type vs the float32 kernel")
    p.add_argument("--kinds", nargs="+", default=["Q4_K", "Q5_K", "Q6_K"],
                   choices=["Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q8_0"])
    p.add_argument("--k", type=positive_int, default=2048, help="input features (a multiple of 256)")
    p.add_argument("--n", type=positive_int, default=2048, help="output features")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--layers", type=positive_int, default=1,
                   help="weights of the shape each kernel cycles through (enough for them to come from memory)")
    p.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    p.add_argument("--threads", type=positive_int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by the thread's CPU time, not the wall clock (needs --threads 1): on a shared "
                        "machine the time spent waiting for a core does not count")
    p.add_argument("--table", action="store_true", help="also print a human-readable table")
    p.set_defaults(func=runs.kquant_matmul)

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
    p.set_defaults(func=runs.latency)

    p = sub.add_parser("structured", help="constrained decoding: step time with JSON-schema masks vs free")
    _common(p)
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=positive_int, default=48)
    p.add_argument("--repeats", type=positive_int, default=2, help="rounds of free and masked, interleaved")
    p.set_defaults(func=runs.structured)

    p = sub.add_parser("batch", help="a Batch API batch beside interactive users: their TTFT p90 with and without "
                                      "it, the batch's share of the idle capacity")
    _common(p)
    p.add_argument("--requests", type=positive_int, default=1000, help="requests in the batch (default 1000)")
    p.add_argument("--users", type=positive_int, default=4, help="interactive users chatting (default 4)")
    p.add_argument("--rounds", type=positive_int, default=1, help="split the requests into this many batches, "
                   "the phases alternating once per batch (default 1: one batch)")
    p.add_argument("--turns", type=positive_int, default=8, help="turns per user in the interactive-alone phase")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="interactive answers' max_tokens")
    p.add_argument("--batch-max-tokens", type=positive_int, default=32, help="batch answers' max_tokens")
    p.add_argument("--think-s", type=float, default=0.5, help="pause between a user's turns (default 0.5 s)")
    p.add_argument("--max-num-seqs", type=positive_int, default=32, help="engine sequences per step (default 32)")
    p.add_argument("--num-blocks", type=positive_int, default=None, help="KV-cache blocks (default: the engine's)")
    p.add_argument("--busy-slots", type=positive_int, default=None,
                   help="the batch.busy_slots setting (default: the settings')")
    p.add_argument("--no-background-interrupt", action="store_true",
                   help="let a batch step run to its end when an interactive request comes in "
                        "(engine.background_interrupt off)")
    p.set_defaults(func=runs.batch)

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
    p.set_defaults(func=runs.serve)

    p = sub.add_parser("streams", help="many concurrent SSE streams through one gateway over a scripted replica: "
                                       "token gap p50..max, gateway CPU per token, starved streams")
    p.add_argument("--streams", type=positive_int, default=1000, help="streams at once (default %(default)s)")
    p.add_argument("--tokens", type=positive_int, default=200, help="tokens per stream (default %(default)s)")
    p.add_argument("--interval-ms", type=float, default=50.0,
                   help="the scripted replica's time between two tokens of a stream (default %(default)s)")
    p.add_argument("--no-direct", action="store_true",
                   help="skip the round with the client on the replica itself (the floor without a gateway)")
    p.add_argument("--moderation", choices=("lexicon", "off"), default="lexicon",
                   help="the gateway's output moderation (default %(default)s; off shows what the check costs)")
    p.add_argument("--quick", action="store_true", help="20 streams of 10 tokens: the run's shape, for tests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", action="store_true", help="also print a table (stderr)")
    p.set_defaults(func=runs.streams)

    p = sub.add_parser("chaos", help="2 HTTP/2 gateways, 3 replicas, PostgreSQL and Redis under seeded faults and "
                                     "mixed traffic; then the invariants (nothing lost, nothing leaked), table and JSON")
    p.add_argument("--minutes", type=positive_float, default=60.0, help="traffic window (default %(default)s)")
    p.add_argument("--short", action="store_true", help="a 150 s window with each fault once (the test suite's run)")
    p.add_argument("--seed", type=int, default=0, help="seeds the traffic and the fault schedule")
    p.add_argument("--json", metavar="FILE", help="also write the JSON result here")
    p.add_argument("--keep", metavar="DIR", help="run in DIR and keep it (logs, database) afterwards")
    p.set_defaults(func=runs.chaos)

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
    p.set_defaults(func=runs.paired)

    p = sub.add_parser("calibrate", help="time the engine's steps by batch shape; write the simulator's step-time model")
    _common(p)
    p.add_argument("--output", default="step_time.json", help="where to write the model JSON (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    p.add_argument("--rounds", type=positive_int, default=1, help="passes over the calibration phases")
    p.set_defaults(func=runs.calibrate)

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
    p.set_defaults(func=runs.router)

    p = sub.add_parser("tools", help="the KV cache during a tool call: hold, evict and auto beside bystander "
                                     "chat, under a light and a memory-tight pool")
    _common(p)
    p.add_argument("--rounds", type=positive_int, default=1, help="passes over the three policies, their order "
                                                                  "rotating (default 1)")
    p.add_argument("--light-blocks", type=positive_int, default=2048, help="KV blocks of the light configuration")
    p.add_argument("--tight-blocks", type=positive_int, default=128, help="KV blocks of the memory-tight one")
    p.add_argument("--tool-answers", type=positive_int, default=8, help="answers that call a tool, per run")
    p.add_argument("--bystanders", type=positive_int, default=2, help="bystander users chatting meanwhile")
    p.add_argument("--quick", action="store_true", help="a tiny workload (a few seconds; for tests)")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG of every figure per policy and configuration")
    p.set_defaults(func=runs.tools)

    p = sub.add_parser("sim-validate", help="the real engine against the simulator at two request rates")
    _common(p)
    p.add_argument("--rates", type=float, nargs=2, default=None, metavar="RPS",
                   help="two request rates (requests/s, Poisson); default: 25%% and 60%% of what the calibrated "
                        "model says this machine sustains")
    p.add_argument("--num-prompts", type=positive_int, default=40)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--step-time", default=None, help="a step-time JSON; default: calibrate first, in the same run")
    p.set_defaults(func=runs.sim_validate)

    p = sub.add_parser("busy", help="one stream's TPOT quiet and beside busy-loop processes, alternated")
    _common(p)
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--prompt-tokens", type=positive_int, default=64)
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--neighbours", type=positive_int, default=1, help="busy-loop processes in the busy rounds")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    p.set_defaults(func=runs.busy)

    p = sub.add_parser("retrieval", help="recall@k of full-text, vector and fused retrieval over chatloom's docs, "
                                          "and the time retrieval adds before an answer")
    _common(p)
    p.add_argument("--k", type=positive_int, default=5, help="passages retrieved per question")
    p.add_argument("--questions", type=positive_int, default=None, help="use only the first N questions")
    p.add_argument("--latency-chunks", type=int, default=1000, help="passages in the latency collection (0: skip)")
    p.add_argument("--chunk-chars", type=positive_int, default=None,
                   help="passage length in characters (default: files.chunk_chars)")
    p.add_argument("--overlap", type=int, default=None,
                   help="characters a passage repeats from the one before (default: files.chunk_overlap_chars)")
    p.add_argument("--pooling", choices=("last", "mean"), default="last",
                   help="how a served model's embeddings pool (with --embedding-model naming it)")
    p.add_argument("--embedding-model", default=None, metavar="NAME",
                   help="what embeds passages and questions: the static embedding model (files.embedding_model's "
                        "default) or a served model's name, e.g. the --model's registry id")
    p.add_argument("--vector-weight", type=float, default=None, metavar="W",
                   help="the vector ranking's weight in the fusion (default: files.vector_weight's for the embedder)")
    p.add_argument("--modes", nargs="+", choices=("fulltext", "vector", "hybrid"),
                   default=["fulltext", "vector", "hybrid"],
                   help="rankings to score (fulltext alone indexes no vectors: no model work)")
    p.add_argument("--db-url", default=None, help="an empty database to index into (default: a fresh SQLite file)")
    p.set_defaults(func=runs.retrieval)

    p = sub.add_parser("checkpoints", help="write random-weight checkpoints of real model shapes (Hugging Face "
                                           "folder and GGUF F16), offline")
    p.add_argument("--shapes", nargs="+", default=None, metavar="SHAPE",
                   help="smollm2-1.7b, qwen2.5-1.5b, llama3.2-3b (default: these three), smolvlm-256m "
                        "(a vision model: Hugging Face folder only)")
    p.add_argument("--out", required=True, help="the folder to write NAME-hf/ and NAME-f16.gguf into")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-q4-k-m", action="store_true",
                   help="write only NAME-q4_k_m-random.gguf instead: Q4_K_M's tensor types with random block "
                        "bytes, in seconds, for speed measurements (no llama-quantize; outputs meaningless)")
    p.set_defaults(func=runs.checkpoints)

    p = sub.add_parser("sizes", help="chatloom, llama-server and vLLM side by side on the same weights, one server "
                                     "at a time: TPOT, TTFT, 8 in flight, a busy neighbour, memory, load time")
    p.add_argument("--model", required=True, action="append", metavar="GGUF",
                   help="a GGUF file (repeat for several models)")
    p.add_argument("--hf-folder", action="append", default=None, metavar="DIR",
                   help="the Hugging Face folder of the same weights, for vLLM (one per --model, in order)")
    p.add_argument("--llama-server", default=None, metavar="PATH", help="llama.cpp's llama-server binary "
                                                                         "(skipped with a note when absent)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="the Python of a virtual environment with vLLM installed (default: this one)")
    p.add_argument("--servers", default=",".join(SIZES_SERVERS),
                   help=f"which servers, comma-separated (default: {','.join(SIZES_SERVERS)})")
    p.add_argument("--quick", action="store_true",
                   help="tiny prompts and 4 output tokens: the run's shape, for a small model (figures mean little)")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="output tokens per request (default 64)")
    p.add_argument("--long-prompt", type=positive_int, default=None, metavar="N",
                   help="tokens of the long prompt (default 4000)")
    p.add_argument("--history", type=positive_int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="tokens of each in-flight conversation's history (default 1000 3000)")
    p.add_argument("--chat-requests", type=positive_int, default=None, metavar="N",
                   help="conversations in the in-flight run (default 16, 8 at a time)")
    p.add_argument("--tpot-requests", type=positive_int, default=None, metavar="N",
                   help="short-prompt requests one at a time for the TPOT p50 (default 3)")
    p.add_argument("--phases", default=None, metavar="LIST",
                   help="which measurements run, comma-separated from short, long, in_flight, busy "
                        "(default: all); the others' figures are null")
    p.add_argument("--threads", type=positive_int, default=None, help="threads for every server (default: theirs)")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="keep each server's log here")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", action="store_true", help="also print a Markdown table per model (stderr)")
    p.add_argument("--load-rounds", type=positive_int, default=None, metavar="N",
                   help="measure only the load to ready (and CPU seconds, memory): every server started N "
                        "times, in turns, on the first --model")
    p.set_defaults(func=runs.sizes)

    p = sub.add_parser("sizes-plot", help="draw `bench sizes` results (one or more JSON files) as one PNG")
    p.add_argument("results", nargs="+", metavar="JSON", help="files written by `chatloom bench sizes --out`")
    p.add_argument("--out", required=True, metavar="PNG")
    p.set_defaults(func=runs.sizes_plot)
