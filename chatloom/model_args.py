"""The model flags every command shares (--model, --dtype, --int8-matmul), written once for the CLI,
the benchmarks and the server, and the int8 switch resolved once, here at the edge: the flag if
given, else the settings tree (CHATLOOM_MODEL__INT8_MATMUL). Below this, code gets a plain bool.
"""
from __future__ import annotations

import argparse

from chatloom.settings import DEFAULTS

INT8_ENV = "CHATLOOM_MODEL__INT8_MATMUL"
BF16_ENV = "CHATLOOM_MODEL__BF16_MATMUL"
DTYPES = ("fp32", "bf16")
# The KV cache's dtypes (chatloom/engine/config.py's KV_CACHE_DTYPES, named here so that building the
# parsers does not import torch; a test keeps the two equal).
KV_CACHE_DTYPE_NAMES = ("fp32", "bf16", "fp16")


def add_model_args(p: argparse.ArgumentParser, *, from_settings: bool = False) -> None:
    """--model, --dtype, --int8-matmul. With `from_settings` (the server) an absent flag is None,
    so the settings file decides; otherwise the defaults apply here."""
    DEFAULT_MODEL = DEFAULTS.model.name
    p.add_argument("--model", default=None if from_settings else DEFAULT_MODEL, metavar="ID|PATH",
                   help=f"registry id (see `chatloom models`), a GGUF file or a Hugging Face folder "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", choices=DTYPES, default=None if from_settings else DEFAULTS.model.dtype,
                   help="weights and KV cache dtype (default fp32: the fast choice on most CPUs)")
    p.add_argument("--int8-matmul", action="store_true", default=None,
                   help=f"multiply quantized GGUF weights with int8 activations: about 1.4x the throughput, "
                        f"slightly less exact (see README; default: ${INT8_ENV}, else on for K-quant files "
                        f"where the CPU has AVX-512 VNNI, or AVX2 without AVX-512)")
    p.add_argument("--mmproj", default=None, metavar="PATH",
                   help="a GGUF decoder's image encoder and projector, llama.cpp's mmproj file (LLaVA, SmolVLM)")


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype, for the commands that size an engine (defaults: chatloom/engine/config.py)."""
    p.add_argument("--kv-cache-dtype", choices=["auto", *KV_CACHE_DTYPE_NAMES], default=None,
                   help="what the KV cache holds: auto (the model's dtype; fp16 with --int8-matmul), or a "
                        "16-bit pool: half the memory per token and faster long-context decoding, not bit-exact")


def int8_matmul(choice: bool | None) -> bool | None:
    """The int8 switch: an explicit choice, else the settings (CHATLOOM_MODEL__INT8_MATMUL), else None: the
    loader decides by the file (on for K-quants, models/loader.py)."""
    if choice is not None:
        return choice
    from chatloom.settings import environment_settings

    return environment_settings().model.int8_matmul


def bf16_matmul(choice: bool | None) -> bool:
    """The bfloat16-weights switch (--bf16-matmul where a command has it): the choice, else the
    settings (CHATLOOM_MODEL__BF16_MATMUL), else off."""
    if choice is not None:
        return choice
    from chatloom.settings import environment_settings

    return environment_settings().model.bf16_matmul


def weight_cache_folder():
    """The folder that keeps packed K-quant weights between starts (CHATLOOM_MODEL__WEIGHT_CACHE, default
    auto: $XDG_CACHE_HOME/chatloom/weights), or None where the settings turn it off."""
    from chatloom.models.panel_cache import cache_folder
    from chatloom.settings import environment_settings

    return cache_folder(environment_settings().model.weight_cache)


def load_from_args(args: argparse.Namespace, kv_cache_bytes=0):
    """The model the flags name, loaded; `kv_cache_bytes` (bytes, or a function of the model's config)
    is the KV pool the caller will allocate, checked with the weights against available memory."""
    from chatloom.models import load_model

    loaded = load_model(args.model, args.dtype, int8_matmul=int8_matmul(args.int8_matmul),
                        kv_cache_bytes=kv_cache_bytes, bf16_matmul=bf16_matmul(getattr(args, "bf16_matmul", None)),
                        weight_cache=weight_cache_folder())
    if getattr(args, "mmproj", None):
        from chatloom.models.vision.mmproj import attach_mmproj

        attach_mmproj(loaded, args.mmproj)
    return loaded
