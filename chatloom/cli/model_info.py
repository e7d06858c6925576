"""`chatloom models` and `chatloom capacity`: what a model is, and how many tokens and
conversations its KV cache fits in a memory budget (no weights are loaded)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

EXAMPLES_DIR = Path(__file__).parents[1] / "examples"


def fmt_int(n: int) -> str:
    return f"{n:,}"


def fmt_binary(n: float) -> str:
    """Bytes in binary units: 327680 -> '320 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.3g} {unit}"


def fmt_decimal(n: float) -> str:
    """Bytes in decimal units: 2621440000 -> '2.62 GB'."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.3g} {unit}"


def fmt_params(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


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
    from chatloom.models.config import DTYPE_BYTES

    per_token = cfg.kv_bytes_per_token(dtype)
    per_conv = per_token * context
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
        "bytes_per_conversation": per_conv,
        "conversations": memory_bytes // per_conv,
    }


def cmd_capacity(args: argparse.Namespace) -> int:
    spec = _capacity_spec(args.model)
    if spec.endswith(".json") and Path(spec).is_file():
        from chatloom.models.hf_config import read_config_file  # a config alone: no need to import torch

        cfg = read_config_file(Path(spec))
    else:
        from chatloom.models import describe_config

        cfg = describe_config(spec)
    memory = int(args.memory_gb * 1e9) if args.memory_gb is not None else int(args.memory_gib * 2**30)
    r = capacity(cfg, memory, args.context, args.dtype)
    if args.weights:
        r["weight_bytes"] = _weight_table(cfg, args.weights)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    per_token, per_conv, n = r["kv_bytes_per_token"], r["bytes_per_conversation"], fmt_int(args.context)
    print(f"model: {cfg.name} ({cfg.architecture}, {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads, "
          f"head dim {cfg.head_dim}, context window {fmt_int(cfg.max_position)} tokens)")
    print(f"KV cache per token ({args.dtype}): {fmt_int(per_token)} bytes ({fmt_binary(per_token)})"
          f" = 2 (K and V) x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} dims"
          f" x {r['dtype_bytes']} byte{'s' if r['dtype_bytes'] > 1 else ''}")
    print(f"KV cache memory: {fmt_int(memory)} bytes ({fmt_decimal(memory)}, {fmt_binary(memory)})")
    print(f"tokens that fit: {fmt_int(r['tokens'])}")
    print(f"one {n}-token conversation: {fmt_int(per_conv)} bytes "
          f"({fmt_decimal(per_conv)}, {fmt_binary(per_conv)})")
    print(f"concurrent {n}-token conversations: {fmt_int(r['conversations'])}")
    if args.context > cfg.max_position:
        print(f"note: {n} tokens is longer than the model's context window ({fmt_int(cfg.max_position)})")
    for kind, size in r.get("weight_bytes", {}).items():
        how = "any file, every weight in bfloat16" if kind == "bf16-model" else f"{kind} file, fp32 model"
        print(f"weights as loaded ({how}): {fmt_int(size)} bytes ({fmt_binary(size)})")
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
