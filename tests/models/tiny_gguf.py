"""Convert a tiny Hugging Face checkpoint of any supported family to GGUF, K-quantized, as
llama.cpp's converter and quantizer lay it out.

What the converter does per family, done here to the same random weights: tensor names
(gguf's own tables), Q/K rows permuted for Llama-architecture files (Mixtral too), Gemma's
norms stored as 1 + w, Phi-3's fused attn_qkv and gate+up ffn_up kept fused, each MoE
projection of all experts stacked into one 3-D tensor, Qwen2-MoE's shared expert and its
gate, and the metadata keys llama.cpp reads (expert counts and sizes, sliding window,
soft-caps, key length).

The gguf package cannot quantize K-types (its quantize raises NotImplementedError for Q4_K,
Q5_K and Q6_K), so the matrices are random K-quant blocks rather than quantized floats: the
file holds those blocks, and the Hugging Face reference holds what gguf's own dequantizer
makes of them, so transformers and chatloom see exactly the same weights.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import tiny_checkpoints as tc

# Hugging Face model_type -> GGUF general.architecture (llama.cpp writes Mixtral as llama).
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "phi3": "phi3", "gemma2": "gemma2",
             "gemma3_text": "gemma3"}
GEMMA = ("gemma2", "gemma3_text")

# Each GGUF stem's K-quant type: a Q4_K_M-like mix that uses all three types in every family.
KINDS = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_qkv": "Q5_K", "attn_output": "Q5_K",
         "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q6_K",
         "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q5_K", "ffn_down_exps": "Q6_K",
         "ffn_gate_shexp": "Q4_K", "ffn_up_shexp": "Q4_K", "ffn_down_shexp": "Q6_K"}

# Sizes that K-quant blocks (256 weights per row block) fit, with each family's extras.
KQUANT_SIZES = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64)
GGUF_FAMILY = {
    # llama.cpp derives Gemma's attention scale from head_dim (the 27B models aside), so the
    # reference uses query_pre_attn_scalar = head_dim.
    "gemma2": dict(query_pre_attn_scalar=64),
    # llama.cpp: five sliding layers in six, and base 10000 for the sliding ones.
    "gemma3_text": dict(query_pre_attn_scalar=64, num_hidden_layers=6, rope_local_base_freq=10000.0,
                        layer_types=["sliding_attention"] * 5 + ["full_attention"]),
    "phi3": dict(sliding_window=12),
    "qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=256),
    "qwen3_moe": dict(moe_intermediate_size=256),
}


def kquant_config(arch: str, **overrides) -> dict:
    return tc.hf_config(arch, **{**KQUANT_SIZES, **GGUF_FAMILY.get(arch, {}), **overrides})


def _gguf_name(arch: str, hf_name: str) -> tuple[str, str | None, int | None]:
    """(GGUF tensor name, stacked name for an expert weight, expert index)."""
    from gguf.constants import MODEL_TENSOR as T, TENSOR_NAMES

    glob = {"model.embed_tokens": T.TOKEN_EMBD, "model.norm": T.OUTPUT_NORM, "lm_head": T.OUTPUT}
    stem, kind = hf_name.rsplit(".", 1)
    if stem in glob:
        return f"{TENSOR_NAMES[glob[stem]]}.{kind}", None, None
    parts = stem.split(".")
    bid, module = int(parts[2]), ".".join(parts[3:])
    gemma = arch in GEMMA
    table = {
        "self_attn.q_proj": T.ATTN_Q, "self_attn.k_proj": T.ATTN_K, "self_attn.v_proj": T.ATTN_V,
        "self_attn.qkv_proj": T.ATTN_QKV, "self_attn.o_proj": T.ATTN_OUT,
        "self_attn.q_norm": T.ATTN_Q_NORM, "self_attn.k_norm": T.ATTN_K_NORM,
        "input_layernorm": T.ATTN_NORM,
        "post_attention_layernorm": T.ATTN_POST_NORM if gemma else T.FFN_NORM,
        "pre_feedforward_layernorm": T.FFN_PRE_NORM, "post_feedforward_layernorm": T.FFN_POST_NORM,
        "mlp.gate_proj": T.FFN_GATE, "mlp.up_proj": T.FFN_UP, "mlp.down_proj": T.FFN_DOWN,
        "mlp.gate_up_proj": T.FFN_UP,  # Phi-3: gate and up fused
        "mlp.gate": T.FFN_GATE_INP, "block_sparse_moe.gate": T.FFN_GATE_INP,
        "mlp.shared_expert.gate_proj": T.FFN_GATE_SHEXP, "mlp.shared_expert.up_proj": T.FFN_UP_SHEXP,
        "mlp.shared_expert.down_proj": T.FFN_DOWN_SHEXP, "mlp.shared_expert_gate": T.FFN_GATE_INP_SHEXP,
    }
    if ".experts." in module:
        expert, proj = int(parts[-2]), parts[-1]
        stacked = {"w1": T.FFN_GATE_EXP, "gate_proj": T.FFN_GATE_EXP, "w3": T.FFN_UP_EXP, "up_proj": T.FFN_UP_EXP,
                   "w2": T.FFN_DOWN_EXP, "down_proj": T.FFN_DOWN_EXP}[proj]
        return "", f"{TENSOR_NAMES[stacked].format(bid=bid)}.{kind}", expert
    return f"{TENSOR_NAMES[table[module]].format(bid=bid)}.{kind}", None, None


def _permute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order for Llama-architecture files (rows only: works on blocks too)."""
    rows = a.shape[0]
    return a.reshape(n_head, 2, rows // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def kquant_gguf(path: Path, cfg: dict, seed: int = 0, stack_experts: bool = True) -> dict[str, torch.Tensor]:
    """Write `cfg`'s family as a K-quantized GGUF at `path`; return the same model's weights
    in Hugging Face naming (norms, routers and biases random floats, every matrix what gguf
    dequantizes its blocks to), for a Hugging Face folder to compare against. Without
    `stack_experts`, experts are written one 2-D tensor each (blk.N.ffn_gate.E.weight), as
    older Mixtral files have them."""
    arch = cfg["model_type"]
    weights = tc.random_weights(cfg, seed)
    ref: dict[str, torch.Tensor] = {}
    tensors: dict[str, tuple[np.ndarray, str | None]] = {}  # GGUF name -> (array, raw K-quant type)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    kinds: dict[str, str] = {}
    for i, (name, t) in enumerate(weights.items()):
        gname, stacked, expert = _gguf_name(arch, name)
        stem = (stacked or gname).split(".")[-2] if (stacked or gname).startswith("blk.") else gname.split(".")[0]
        kind = KINDS.get(stem) if t.dim() == 2 else None
        if kind is None:
            ref[name] = t
            arr = t.numpy().astype(np.float32)
            if arch in GEMMA and name.endswith("norm.weight"):
                arr = arr + 1.0  # llama.cpp's converter stores Gemma's 1 + w
        else:
            arr = tc.random_kquant_blocks(kind, t.shape[0], t.shape[1], seed * 1000 + i)
            ref[name] = tc.dequantize(kind, arr)
        if GGUF_ARCH[arch] == "llama" and stem in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if stem == "attn_q" else cfg["num_key_value_heads"]
            arr = _permute_rows(arr, heads)
        if stacked:
            stacks.setdefault(stacked, {})[expert] = arr
            kinds[stacked] = kind
        else:
            tensors[gname] = (arr, kind)
    for stacked, parts in stacks.items():
        if stack_experts:
            tensors[stacked] = (np.stack([parts[e] for e in sorted(parts)]), kinds[stacked])
            continue
        blk, bid, stem, kind = stacked.split(".")
        for e in sorted(parts):  # ffn_gate_exps -> ffn_gate.E
            tensors[f"{blk}.{bid}.{stem[:-len('_exps')]}.{e}.{kind}"] = (parts[e], kinds[stacked])
    _write(path, cfg, tensors)
    return ref


def _write(path: Path, cfg: dict, tensors: dict[str, tuple[np.ndarray, str | None]]) -> None:
    import gguf

    arch = cfg["model_type"]
    w = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    w.add_name("tiny-test")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if arch in GEMMA:
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg.get("sliding_window") and arch in GEMMA + ("phi3",):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "mixtral":
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch in ("qwen2_moe", "qwen3_moe"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    tokens = tc.vocab_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in tc.SPECIALS else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in tc.MERGES])
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(tc.CHAT_TEMPLATE)
    for name, (arr, kind) in tensors.items():
        if kind is None:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            w.add_tensor(name, np.ascontiguousarray(arr), raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
