"""`chatloom replica`: one engine behind its own OpenAI-compatible HTTP face, for a router to use.

The model loads and its engine is built before the port opens, so a model that cannot load (a bad
path, an unsupported architecture, too little memory) is one line on stderr and exit status 2, and a
router never sees a half-ready replica on the port.
"""
from __future__ import annotations

import argparse
import asyncio
import sys

from chatloom.argtypes import positive_float, positive_int
from chatloom.model_args import add_kv_cache_dtype_arg


def cmd_replica(args: argparse.Namespace) -> int:
    import logging

    import torch
    import uvicorn

    from chatloom.engine import EngineConfig
    from chatloom.model_args import bf16_matmul, int8_matmul, load_from_args
    from chatloom.models import ModelError
    from chatloom.serving.backend import ModelLoadFailed
    from chatloom.serving.local import LocalBackend
    from chatloom.serving.replica_server import create_replica_app

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sizing = {k: getattr(args, k) for k in ("kv_cache_gb", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                                            "max_model_len", "seed", "kv_cache_dtype")}
    # Flags left out keep the engine's own defaults (chatloom/engine/config.py), written only there.
    config = EngineConfig(**{k: v for k, v in sizing.items() if v is not None})
    # The same pool the backend will plan, checked with the weights before they are read.
    plan = LocalBackend(args.model, dtype=args.dtype, engine_config=config, int8_matmul=int8_matmul(args.int8_matmul),
                        bf16_matmul=bf16_matmul(getattr(args, "bf16_matmul", None)))
    loaded = load_from_args(args, kv_cache_bytes=plan.kv_cache_bytes)
    backend = LocalBackend(loaded, engine_config=config, pooling=args.pooling)
    try:  # the engine and its KV pool too, before the port opens
        asyncio.run(backend.start())
    except ModelLoadFailed as exc:
        raise ModelError(str(exc)) from None
    app = create_replica_app(backend)
    print(f"chatloom: replica serving {loaded.id} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """Engine sizing flags shared by `chatloom replica` and the local replicas `chatloom serve` starts."""
    p.add_argument("--kv-cache-gb", type=positive_float, default=None, help="KV pool size in GiB")
    p.add_argument("--num-blocks", type=positive_int, default=None, help="KV pool size in blocks (overrides GiB)")
    p.add_argument("--max-num-seqs", type=positive_int, default=None, help="sequences per engine step")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="token budget per engine step")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context window (default: the model's, at most 8192)")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads for the model (default: torch's)")


def register(subparsers: argparse._SubParsersAction) -> None:
    from chatloom.model_args import add_model_args

    p = subparsers.add_parser("replica", help="serve one model engine over an OpenAI-compatible API for a router")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=positive_int, default=8100, help="port (default 8100)")
    p.add_argument("--seed", type=int, default=None, help="seed for unseeded sampled requests")
    p.add_argument("--pooling", choices=("last", "mean"), default="last",
                   help="how /v1/embeddings pools the final hidden states (default: the last token's)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning")
    add_replica_args(p)
    p.set_defaults(func=cmd_replica)
