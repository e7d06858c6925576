"""`chatloom replica`: one engine behind its own OpenAI-compatible HTTP face, for a router to use.

The model loads and its engine is built before the port opens, so a model that cannot load (a bad
path, an unsupported architecture, too little memory) is one line on stderr and exit status 2, and a
router never sees a half-ready replica on the port.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from chatloom.argtypes import nonnegative_float, positive_float, positive_int, slowdown
from chatloom.model_args import add_kv_cache_dtype_arg

if TYPE_CHECKING:
    from chatloom.engine import EngineConfig


def cmd_replica(args: argparse.Namespace) -> int:
    import logging

    import torch
    import uvicorn

    from chatloom.model_args import bf16_matmul, int8_matmul, load_from_args
    from chatloom.models import ModelError
    from chatloom.serving import gc_pacing
    from chatloom.serving.backend import ModelLoadFailed
    from chatloom.serving.local import LocalBackend
    from chatloom.serving.replica_server import create_replica_app
    from chatloom.settings import environment_settings

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config(args)
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
    gc_pacing.start(environment_settings().runtime)  # the model is loaded: it is never walked again
    print(f"chatloom: replica serving {loaded.id} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def engine_config(args: argparse.Namespace) -> "EngineConfig":
    """The replica's EngineConfig from its flags; flags left out keep the engine's own defaults
    (chatloom/engine/config.py), written only there."""
    from chatloom.engine import EngineConfig

    given = {k: getattr(args, k) for k in ENGINE_FLAGS}
    return EngineConfig(**{k: v for k, v in given.items() if v is not None})


# The EngineConfig fields a replica's flags set (add_replica_args, and --seed).
ENGINE_FLAGS = ("kv_cache_gb", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "seed",
                "kv_cache_dtype", "encoder_cache_mb", "encoder_max_slowdown")


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """Engine sizing flags shared by `chatloom replica` and the local replicas `chatloom serve` starts."""
    p.add_argument("--kv-cache-gb", type=positive_float, default=None, help="KV pool size in GiB")
    p.add_argument("--num-blocks", type=positive_int, default=None, help="KV pool size in blocks (overrides GiB)")
    p.add_argument("--max-num-seqs", type=positive_int, default=None, help="sequences per engine step")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="token budget per engine step")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context window (default: the model's, at most 8192)")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--encoder-cache-mb", type=nonnegative_float, default=None,
                   help="memory for image embeddings kept by image hash (vision models; 0 keeps none)")
    p.add_argument("--encoder-max-slowdown", type=slowdown, default=None, metavar="F",
                   help="the most the image encoder may add to the time of steps shared with other requests, "
                        "as a fraction (inf: the step's token budget alone bounds it)")
    # The matmul switches both ways, so that a replica started for a gateway follows its settings exactly
    # (--int8-matmul is add_model_args').
    p.add_argument("--no-int8-matmul", dest="int8_matmul", action="store_false", default=None,
                   help="keep quantized GGUF weights' matmuls exact")
    p.add_argument("--bf16-matmul", action=argparse.BooleanOptionalAction, default=None,
                   help="keep float weights in bfloat16 for the matmuls (default: $CHATLOOM_MODEL__BF16_MATMUL, "
                        "else off)")
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
