"""Perplexity of a model on a short public-domain text shipped with chatloom.

What a quantization type or a matmul mode costs in quality, measured the same way for each:
the text (texts/public_domain.txt: Lincoln's Gettysburg Address, the opening of the
Declaration of Independence and of Pride and Prejudice, about 4 KB) is cut into windows
of consecutive tokens; each token after the first of its window is scored by the model given
the tokens before it in the window; perplexity is exp of the mean negative log-likelihood.
Modes are run one after another on the same tokens, in one process, so their figures compare:
exact (float32, quantized weights expanded exactly), int8 (int8 activations against the
quantized weights, with its default 16-bit KV cache) and bf16 (bfloat16 weights and activations).
A mode may name its KV cache's dtype ("int8+bf16kv", "exact+fp16kv"): the window is then run
through a paged KV pool of that dtype, so every key and value is rounded as the engine keeps it.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

TEXT = Path(__file__).parent / "texts" / "public_domain.txt"
MODES = ("exact", "int8", "bf16", "exact+fp16kv", "exact+bf16kv", "int8+fp32kv", "int8+bf16kv")


def parse_mode(mode: str) -> tuple[str, str]:
    """(matmul mode, KV cache dtype choice): "int8+bf16kv" -> ("int8", "bf16"); "int8" -> ("int8", "auto")."""
    matmul, _, kv = mode.partition("+")
    return matmul, kv.removesuffix("kv") or "auto"


def windows(ids: list[int], size: int) -> list[list[int]]:
    """Consecutive windows of `size` tokens (the last may be shorter), one-token windows dropped."""
    return [w for w in (ids[i:i + size] for i in range(0, len(ids), size)) if len(w) > 1]


def cached_logits(model, chunk: list[int], kv_dtype: torch.dtype, block_size: int = 16) -> torch.Tensor:
    """Logits for every position of `chunk`, its K/V written to (and read back as) a paged pool of
    `kv_dtype`, as the engine's prefill does."""
    from chatloom.models.attention import AttentionBatch, PrefillSegment

    cfg, n = model.config, len(chunk)
    shape = (-(-n // block_size), block_size, cfg.num_kv_heads, cfg.head_dim)
    pools = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)) for _ in range(cfg.num_layers)]
    batch = AttentionBatch(prefills=[PrefillSegment(0, n, n, None)], slot_mapping=torch.arange(n),
                           block_size=block_size)
    return model.compute_logits(model(torch.tensor(chunk), torch.arange(n), batch, pools))


@torch.inference_mode()
def negative_log_likelihood(model, chunks: list[list[int]], kv_dtype: torch.dtype | None = None
                            ) -> tuple[float, int]:
    """Sum of -log p(token | earlier tokens of its window) and the number of tokens scored; with
    `kv_dtype`, through a KV pool of that dtype (cached_logits)."""
    total, count = 0.0, 0
    for chunk in chunks:
        full = model.dense_logits([chunk])[0] if kv_dtype is None else cached_logits(model, chunk, kv_dtype)
        logits = full[:-1].double()
        targets = torch.tensor(chunk[1:])
        total -= float(torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).sum())
        count += len(chunk) - 1
    return total, count


def _load(spec: str, mode: str):
    from chatloom.models import load_model

    if mode == "bf16":
        return load_model(spec, "bf16", int8_matmul=False)
    return load_model(spec, "fp32", int8_matmul=mode == "int8")


def run_perplexity(spec: str, modes: list[str], window: int | None = None, text_path: Path = TEXT,
                   max_tokens: int | None = None) -> dict:
    from chatloom.engine.config import resolve_kv_cache_dtype
    from chatloom.models.packed_linear import uses_int8_matmul

    text = Path(text_path).read_text(encoding="utf-8")
    results: dict[str, dict] = {}
    ids: list[int] | None = None
    size = window
    for mode in modes:
        t0 = time.perf_counter()
        matmul, kv_choice = parse_mode(mode)
        loaded = _load(spec, matmul)
        load_s = time.perf_counter() - t0
        int8 = uses_int8_matmul(loaded.model)
        if matmul == "int8" and not int8:
            results[mode] = {"skipped": "no layer of this model multiplies with int8 activations "
                                        "(no GGUF-quantized weights with an int8 kernel, or no AVX2)"}
            continue
        if ids is None:  # the same tokens for every mode
            ids = loaded.tokenizer.encode(text)[:max_tokens]
            size = min(window or 512, loaded.config.max_position)
        kv_dtype = resolve_kv_cache_dtype(kv_choice, loaded.dtype, int8)
        t0 = time.perf_counter()
        nll, count = negative_log_likelihood(loaded.model, windows(ids, size),
                                             None if kv_dtype == loaded.dtype else kv_dtype)
        results[mode] = {"perplexity": round(math.exp(nll / count), 4), "mean_nll": round(nll / count, 5),
                         "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
                         "tokens_scored": count, "seconds": round(time.perf_counter() - t0, 2),
                         "load_seconds": round(load_s, 2)}
        del loaded
    base = results.get("exact", {}).get("perplexity")
    ratios = {f"{m}/exact": round(r["perplexity"] / base, 4) for m, r in results.items()
              if m != "exact" and base and "perplexity" in r}
    return {"benchmark": "perplexity", "model": spec, "text": Path(text_path).name, "tokens": len(ids or []),
            "window": size, "modes": results, "perplexity_ratio": ratios}
