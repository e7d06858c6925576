"""`chatloom models` and `chatloom capacity`: what a model is, and how many tokens and
conversations its KV cache fits in a memory budget (no weights are loaded)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from chatloom.cli.units import fmt_binary, fmt_decimal, fmt_int, fmt_params

EXAMPLES_DIR = Path(__file__).parents[1] / "examples"


# -- models --------------------------------------------------------------------------

def describe(spec: str, entry=None) -> dict[str, Any]:
    from chatloom.models import describe_config

    cfg = describe_config(spec)
    return {
        "id": spec,
        "description": entry.description if entry else "",
        "test_only": bool(entry and entry.test_only),
        "architecture": cfg.architecture,
        "parameters": cfg.num_parameters(),
        "context_length": cfg.max_position,
        "layers": cfg.num_layers,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "kv_bytes_per_token": {d: cfg.kv_bytes_per_token(d) for d in ("fp32", "bf16")},
    }


def _bytes_cell(n: int) -> str:
    return f"{fmt_int(n)} B" + (f" ({fmt_binary(n)})" if n >= 1024 else "")


def cmd_models(args: argparse.Namespace) -> int:
    from chatloom.models import ModelError
    from chatloom.models.registry import REGISTRY

    rows = []
    for spec in args.specs or list(REGISTRY):
        entry = REGISTRY.get(spec)
        try:
            rows.append(describe(spec, entry))
        except ModelError as exc:
            if args.specs:
                raise
            rows.append({"id": spec, "description": entry.description if entry else "",
                         "error": str(exc)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    head = ("ID", "PARAMS", "CONTEXT", "LAYERS", "KV HEADS", "HEAD DIM", "KV/TOKEN fp32", "KV/TOKEN bf16")
    table = [head]
    for r in rows:
        if "error" in r:
            table.append((r["id"], "-", "-", "-", "-", "-", "-", "-"))
            continue
        kv = r["kv_bytes_per_token"]
        table.append((r["id"], fmt_params(r["parameters"]), fmt_int(r["context_length"]), str(r["layers"]),
                      str(r["kv_heads"]), str(r["head_dim"]),
                      _bytes_cell(kv["fp32"]), _bytes_cell(kv["bf16"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print()
    for r in rows:
        note = f"unavailable: {r['error']}" if "error" in r else r["description"]
        print(f"{r['id']}: {note}{' (for tests)' if r.get('test_only') else ''}")
    return 0


# -- capacity ------------------------------------------------------------------------

def _capacity_spec(spec: str) -> str:
    """A registry id or path, or the name of a shipped example config (e.g. llama-70b)."""
    from chatloom.models.registry import REGISTRY

    example = EXAMPLES_DIR / f"{spec}.json"
    if spec not in REGISTRY and not Path(spec).exists() and example.is_file():
        return str(example)
    return spec


def capacity(cfg, memory_bytes: int, context: int, dtype: str) -> dict[str, Any]:
    from chatloom.engine.kv_sizing import uniform_window, window_tokens
    from chatloom.models.config import DTYPE_BYTES

    per_token = cfg.kv_bytes_per_token(dtype)
    # With a window on every layer the engine gives back the blocks that leave it: a conversation
    # holds at most a window's worth, however long it grows.
    window = uniform_window(cfg.layer_windows)
    held = window_tokens(window, context, 16)
    per_conv = per_token * held
    return {
        "model": cfg.name,
        "architecture": cfg.architecture,
        "layers": cfg.num_layers,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "context_window": cfg.max_position,
        "dtype": dtype,
        "dtype_bytes": DTYPE_BYTES[dtype],
        "kv_bytes_per_token": per_token,
        "memory_bytes": memory_bytes,
        "tokens": memory_bytes // per_token,
        "context": context,
        "sliding_window": window,
        "tokens_held_per_conversation": held,
        "bytes_per_conversation": per_conv,
        "conversations": memory_bytes // per_conv,
    }


def cmd_capacity(args: argparse.Namespace) -> int:
    from chatloom.cli import capacity_media as media

    spec = _capacity_spec(args.model)
    raw = media.raw_config(spec)
    if raw is not None and raw.get("model_type") in media.SPEECH:
        from chatloom.settings import environment_settings

        s = media.speech_report(raw, environment_settings().speech.max_batch)
        if args.json:
            print(json.dumps({"model": Path(spec).stem if spec.endswith(".json") else Path(spec).name,
                              "speech": s}, indent=2))
        else:
            media.print_speech(Path(spec).stem if spec.endswith(".json") else Path(spec).name, s)
        return 0
    if spec.endswith(".json") and Path(spec).is_file():
        from chatloom.models.hf_config import read_config_file  # a config alone: no need to import torch

        cfg = read_config_file(Path(spec))
    else:
        from chatloom.models import describe_config

        cfg = describe_config(spec)
    vision = None
    if raw is not None and raw.get("model_type") in media.VISION:
        from chatloom.settings import environment_settings

        settings = environment_settings()
        dtype = args.dtype or ("fp16" if args.memory_gb or args.memory_gib else "fp32")
        vision = media.vision_report(raw, cfg.name, 2 if settings.model.dtype == "bf16" else 4,
                                     cfg.kv_bytes_per_token(dtype), settings.engine.encoder_cache_mb)
    if args.memory_gb is None and args.memory_gib is None:
        code = _default_pool(cfg, spec, args, vision)
        if vision is not None and not args.json:
            media.print_vision(vision)
        return code
    memory = int(args.memory_gb * 1e9) if args.memory_gb is not None else int(args.memory_gib * 2**30)
    r = capacity(cfg, memory, args.context or 8000, args.dtype or "fp16")
    if args.weights:
        r["weight_bytes"] = _weight_table(cfg, args.weights)
    if vision is not None:
        r["vision"] = vision
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    per_conv, n = r["bytes_per_conversation"], fmt_int(r["context"])
    _print_per_token(cfg, r["dtype"], r["kv_bytes_per_token"], r["dtype_bytes"])
    print(f"KV cache memory: {fmt_int(memory)} bytes ({fmt_decimal(memory)}, {fmt_binary(memory)})")
    print(f"tokens that fit: {fmt_int(r['tokens'])}")
    _print_window(r)
    print(f"one {n}-token conversation: {fmt_int(per_conv)} bytes "
          f"({fmt_decimal(per_conv)}, {fmt_binary(per_conv)})")
    print(f"concurrent {n}-token conversations: {fmt_int(r['conversations'])}")
    if r["context"] > cfg.max_position:
        print(f"note: {n} tokens is longer than the model's context window ({fmt_int(cfg.max_position)})")
    for kind, size in r.get("weight_bytes", {}).items():
        how = "any file, every weight in bfloat16" if kind == "bf16-model" else f"{kind} file, fp32 model"
        print(f"weights as loaded ({how}): {fmt_int(size)} bytes ({fmt_binary(size)})")
    if vision is not None:
        media.print_vision(vision)
    return 0


def _print_per_token(cfg, dtype: str, per_token: int, dtype_bytes: int) -> None:
    print(f"model: {cfg.name} ({cfg.architecture}, {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads, "
          f"head dim {cfg.head_dim}, context window {fmt_int(cfg.max_position)} tokens)")
    print(f"KV cache per token ({dtype}): {fmt_int(per_token)} bytes ({fmt_binary(per_token)})"
          f" = 2 (K and V) x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} dims"
          f" x {dtype_bytes} byte{'s' if dtype_bytes > 1 else ''}")


def _print_window(r: dict[str, Any]) -> None:
    if r["sliding_window"] is not None and r["tokens_held_per_conversation"] < r["context"]:
        print(f"sliding window of {fmt_int(r['sliding_window'])} tokens on every layer: a conversation holds "
              f"at most {fmt_int(r['tokens_held_per_conversation'])} tokens' KV (older blocks are given back)")


def _weight_estimate(spec: str, cfg) -> int:
    """Bytes the weights will take once loaded with the default settings (float32; int8 activations for
    a K-quant file where the CPU has the kernel), or 0 for a config alone."""
    from chatloom.models.memory_check import dense_weight_bytes, gguf_weight_bytes
    from chatloom.models.registry import DEFAULT_MODEL

    if spec == DEFAULT_MODEL:
        from chatloom.models.registry import smollm2_path

        spec = str(smollm2_path())
    path = Path(spec)
    if path.is_file() and path.suffix != ".json":
        import torch

        from chatloom.models.gguf_loader import open_gguf
        from chatloom.models.loader import gguf_layout

        reader = open_gguf(path)
        keeps, int8, super_blocks = gguf_layout(reader, torch.float32, None, False)
        return gguf_weight_bytes(reader.tensors, 4, keeps, super_blocks, int8_activations=int8)
    return dense_weight_bytes(cfg, 4) if path.is_dir() else 0


def _default_pool(cfg, spec: str, args: argparse.Namespace, vision: dict | None = None) -> int:
    """The KV pool `chatloom serve` gives this model with the current settings, and its arithmetic."""
    import torch

    from chatloom.engine.config import KV_CACHE_DTYPES, EngineConfig, resolve_kv_cache_dtype
    from chatloom.engine.kv_sizing import AUTO_KV_CONTEXTS, AUTO_KV_MEMORY_SHARE, uniform_window
    from chatloom.settings import environment_settings

    settings = environment_settings()
    config = EngineConfig.from_settings(settings.engine)
    if args.dtype is not None:
        if args.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"the engine's KV cache cannot hold {args.dtype}: use {', '.join(KV_CACHE_DTYPES)}")
        config.kv_cache_dtype = args.dtype
    if args.context is not None:
        config.max_model_len = args.context
    model_dtype = torch.bfloat16 if settings.model.dtype == "bf16" else torch.float32
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, model_dtype, settings.model.int8_matmul,
                                      settings.model.bf16_matmul)
    dtype = next(k for k, v in KV_CACHE_DTYPES.items() if v == kv_dtype)
    per_token = cfg.kv_bytes_per_token("fp32") * kv_dtype.itemsize // 4
    weights = _weight_estimate(spec, cfg)
    if vision is not None and weights:  # a vision folder: its encoder and projector load too
        weights += vision["encoder_weight_bytes"]
    plan = config.plan_kv_pool(per_token, cfg.max_position, uniform_window(cfg.layer_windows), reserved=weights)
    r = {"model": cfg.name, "architecture": cfg.architecture, "dtype": dtype, "kv_bytes_per_token": per_token,
         "weight_bytes_estimate": weights, "contexts_wanted": AUTO_KV_CONTEXTS,
         "memory_share": AUTO_KV_MEMORY_SHARE, "sliding_window": uniform_window(cfg.layer_windows),
         "context": plan.context_tokens, "tokens_held_per_conversation": plan.tokens_per_context,
         "pool": plan.as_dict(), "context_window": min(plan.context_tokens, plan.tokens)}
    if vision is not None:
        r["vision"] = vision
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    _print_per_token(cfg, dtype, per_token, kv_dtype.itemsize)
    n, per_ctx = fmt_int(plan.context_tokens), plan.tokens_per_context * per_token
    _print_window(r)
    if plan.how == "num_blocks":
        print(f"pool: num_blocks = {fmt_int(plan.blocks)} (set)")
    elif plan.how == "kv_cache_gb":
        print(f"pool: kv_cache_gb = {config.kv_cache_gb} (set)")
    else:
        print(f"wanted: {AUTO_KV_CONTEXTS} sequences x {fmt_int(plan.tokens_per_context)} tokens x "
              f"{fmt_int(per_token)} bytes = {fmt_int(plan.wanted_bytes)} bytes ({fmt_binary(plan.wanted_bytes)})")
        if plan.available_bytes is None:
            print("memory available: unknown, so one full context")
        else:
            free = plan.available_bytes + weights
            print(f"memory available now: {fmt_binary(free)}; less the weights ({fmt_binary(weights)}): "
                  f"{fmt_binary(plan.available_bytes)}; the pool may take {AUTO_KV_MEMORY_SHARE:g} of it: "
                  f"{fmt_binary(plan.cap_bytes)}")
    print(f"pool: {fmt_int(plan.blocks)} blocks x {plan.block_size} tokens = {fmt_int(plan.tokens)} tokens, "
          f"{fmt_int(plan.bytes)} bytes ({fmt_binary(plan.bytes)})")
    print(f"context window: {fmt_int(r['context_window'])} tokens; full-length ({n}-token) sequences at once: "
          f"{plan.full_contexts:.2f} ({fmt_binary(per_ctx)} each)")
    return 0


def _weight_table(cfg, which: str) -> dict[str, int]:
    """Bytes of weights chatloom holds per file type (all of them, or one), plus the
    --dtype bf16 model (any file, every weight dequantized to bfloat16)."""
    from chatloom.models.weight_memory import FILE_TYPES, weight_bytes

    kinds = FILE_TYPES if which == "all" else (which,)
    table = {k: weight_bytes(cfg, k) for k in kinds}
    if which == "all":
        table["bf16-model"] = weight_bytes(cfg, "BF16", float_bytes=2, keeps_quantized=False)
    return table
