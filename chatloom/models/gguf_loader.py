"""Read a GGUF file: architecture, dequantized weights, tokenizer and chat template."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatloom.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelError

# GGUF tensor name stem -> Hugging Face name stem (per layer unless marked global).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except FileNotFoundError:
        raise ModelError(f"model file not found: {path}") from None
    except Exception as exc:  # the reader raises bare ValueErrors etc. on corrupt files
        raise ModelError(f"cannot read GGUF file {path}: {exc}") from None


def field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def read_config(reader: Any, name: str) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def need(key: str) -> Any:
        v = field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelError(f"GGUF metadata lacks {arch}.{key}")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = field(reader, f"{arch}.vocab_size") or len(field(reader, "tokenizer.ggml.tokens", []))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(field(reader, f"{arch}.attention.key_length") or hidden // heads),
        max_position=int(need("context_length")),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base") or 10000.0),
        # llama.cpp's converter permutes Q/K of llama/mistral models for its interleaved RoPE;
        # qwen2 keeps the half-rotation ("neox") layout.
        rope_interleaved=arch in ("llama", "mistral"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        name=name,
    )


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        stem = _LAYER_NAMES.get(parts[2])
        return stem and f"model.layers.{parts[1]}.{stem}.{parts[3]}"
    stem = _GLOBAL_NAMES.get(parts[0])
    return stem and f"{stem}.{parts[1]}"


def read_weights(reader: Any) -> dict[str, torch.Tensor]:
    """Every tensor, dequantized to float32, keyed by its Hugging Face name."""
    from gguf import quants

    out = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        try:
            arr = quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {exc}") from None
        out[name] = torch.from_numpy(np.require(arr, dtype=np.float32, requirements=["C", "W"]))
    return out
