"""Write tiny random checkpoints to disk, as Hugging Face folders and as GGUF files.

Both formats hold the same weights and the same byte-level BPE tokenizer, so a model
loaded from either must give the same logits (and the same as transformers).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A few merges so the BPE does more than split bytes.
MERGES = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("1", "2"), ("12", "3")]

BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False)


def vocab_tokens() -> list[str]:
    """The token strings in id order: 256 byte symbols, the merges, then the specials."""
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += ["".join(m) for m in MERGES]
    return tokens + SPECIALS


def build_tokenizer() -> Tokenizer:
    tokens = vocab_tokens()
    vocab = {t: i for i, t in enumerate(tokens) if t not in SPECIALS}
    tok = Tokenizer(models.BPE(vocab, MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert [tok.token_to_id(s) for s in SPECIALS] == [tokens.index(s) for s in SPECIALS]
    return tok


_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# What each family adds to BASE (small windows and caps, so that short test sequences reach them).
FAMILY = {
    "qwen3": dict(use_sliding_window=False),
    "phi3": dict(sliding_window=None, pad_token_id=None),
    "gemma2": dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=6,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True,
                   pad_token_id=None),
    "gemma3_text": dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=6,
                        layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=100.0,
                        rope_theta=1000.0, tie_word_embeddings=True, pad_token_id=None),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False,
                      shared_expert_intermediate_size=40, decoder_sparse_step=1, mlp_only_layers=[1],
                      use_sliding_window=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False),
}


def hf_config(model_type: str = "llama", **overrides) -> dict:
    cfg = {"model_type": model_type, "architectures": [_ARCH_CLASSES[model_type]],
           "vocab_size": len(vocab_tokens()), "bos_token_id": None,
           "eos_token_id": vocab_tokens().index("<|im_end|>"), **BASE, **FAMILY.get(model_type, {})}
    if model_type == "qwen2":
        cfg["use_sliding_window"] = False
    if model_type == "mistral":
        cfg["sliding_window"] = None
    cfg.update(overrides)
    return cfg


def _moe_layers(cfg: dict) -> list[bool]:
    n = cfg["num_hidden_layers"]
    if cfg["model_type"] == "mixtral":
        return [True] * n
    if cfg["model_type"] in ("qwen2_moe", "qwen3_moe"):
        return [i not in cfg.get("mlp_only_layers", []) for i in range(n)]
    return [False] * n


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights in each family's own Hugging Face naming (as published checkpoints have them)."""
    g = torch.Generator().manual_seed(seed)
    arch = cfg["model_type"]
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q = cfg["num_attention_heads"] * d
    kv = cfg["num_key_value_heads"] * d
    gemma = arch in ("gemma2", "gemma3_text")

    def rnd(*shape: int, scale: float | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    def norm(n: int) -> torch.Tensor:  # Gemma stores w for a norm that multiplies by 1 + w
        return rnd(n, scale=0.1) + (0.0 if gemma else 1.0)

    w = {"model.embed_tokens.weight": rnd(v, h, scale=1.0 / (h ** 0.5 if gemma else 1.0)),
         "model.norm.weight": norm(h)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(v, h)
    for n, moe in enumerate(_moe_layers(cfg)):
        p = f"model.layers.{n}."
        if arch == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = rnd(q + 2 * kv, h)
        else:
            w.update({p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                      p + "self_attn.v_proj.weight": rnd(kv, h)})
        w[p + "self_attn.o_proj.weight"] = rnd(h, q)
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(h)
            w[p + "post_feedforward_layernorm.weight"] = norm(h)
        if arch in ("qwen3", "qwen3_moe", "gemma3_text"):
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        if arch in ("qwen2", "qwen2_moe"):
            w.update({p + "self_attn.q_proj.bias": rnd(q, scale=0.1), p + "self_attn.k_proj.bias": rnd(kv, scale=0.1),
                      p + "self_attn.v_proj.bias": rnd(kv, scale=0.1)})
        if not moe:
            if arch == "phi3":
                w[p + "mlp.gate_up_proj.weight"] = rnd(2 * i, h)
            else:
                w.update({p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h)})
            w[p + "mlp.down_proj.weight"] = rnd(h, i)
        elif arch == "mixtral":
            w[p + "block_sparse_moe.gate.weight"] = rnd(cfg["num_local_experts"], h, scale=1.0)
            for e in range(cfg["num_local_experts"]):
                ex = f"{p}block_sparse_moe.experts.{e}."
                w.update({ex + "w1.weight": rnd(i, h), ex + "w3.weight": rnd(i, h), ex + "w2.weight": rnd(h, i)})
        else:
            mi = cfg["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = rnd(cfg["num_experts"], h, scale=1.0)
            for e in range(cfg["num_experts"]):
                ex = f"{p}mlp.experts.{e}."
                w.update({ex + "gate_proj.weight": rnd(mi, h), ex + "up_proj.weight": rnd(mi, h),
                          ex + "down_proj.weight": rnd(h, mi)})
            si = cfg.get("shared_expert_intermediate_size")
            if arch == "qwen2_moe" and si:
                sh = p + "mlp.shared_expert."
                w.update({sh + "gate_proj.weight": rnd(si, h), sh + "up_proj.weight": rnd(si, h),
                          sh + "down_proj.weight": rnd(h, si), p + "mlp.shared_expert_gate.weight": rnd(1, h)})
    return {k: t.contiguous() for k, t in w.items()}


def write_hf_folder(folder: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(weights, str(folder / "model.safetensors"))
    build_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE}))
    return folder


def permute_for_gguf(w: torch.Tensor, n_head: int) -> np.ndarray:
    """Q/K rows reordered the way llama.cpp's converter does for llama models,
    so that rotating adjacent pairs equals Hugging Face's rotate-half RoPE."""
    out, inp = w.shape
    return (w.numpy().reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp))


_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def write_gguf(path: Path, cfg: dict, weights: dict[str, torch.Tensor], pre: str = "default",
               raw_blocks: dict[str, tuple[str, np.ndarray]] | None = None) -> Path:
    """The same model as a GGUF file: F32 tensors, gpt2-style BPE tokenizer metadata
    (`pre` names the pre-tokenizer, as llama.cpp's tokenizer.ggml.pre does). `raw_blocks`
    gives some tensors (by GGUF name) as quantized blocks, written as they are."""
    import gguf

    arch = cfg["model_type"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_file_type(0)  # all F32
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type")
    if kind == "llama3":
        # llama.cpp's converter stores the llama3 rule as a divisor per frequency.
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(cfg))
    elif kind in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(kind))
        w.add_rope_scaling_factor(scaling["factor"])
        if scaling.get("original_max_position_embeddings"):
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])

    tokens = vocab_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    permute = arch in ("llama", "mistral")
    for name, t in weights.items():
        if name in _GGUF_GLOBAL:
            gname = _GGUF_GLOBAL[name]
        else:
            parts = name.split(".")  # model.layers.N.<module>.<sub>.weight|bias
            layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            gname = f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"
        if raw_blocks and gname in raw_blocks:
            kind, raw = raw_blocks[gname]
            w.add_tensor(gname, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        if permute and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads"] if "attn_q" in gname else cfg["num_key_value_heads"]
            arr = permute_for_gguf(t, heads)
        else:
            arr = t.numpy()
        w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_freq_factors(cfg: dict) -> np.ndarray:
    """The divisor of each RoPE frequency under llama3 scaling (1: kept; factor: interpolated;
    in between, smoothly), as GGUF files carry it."""
    sc, d = cfg["rope_scaling"], cfg["head_dim"]
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    original = sc["original_max_position_embeddings"]
    out = []
    for i in range(0, d, 2):
        wavelen = 2 * np.pi * cfg["rope_theta"] ** (i / d)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def transformers_model(folder: Path):
    """transformers' own implementation of the checkpoint in `folder`, in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.inference_mode()
def transformers_logits(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    return [model(torch.tensor([s])).logits[0].float() for s in seqs]


def random_blocks(kind: str, rows: int, cols: int, seed: int, scale: float = 0.05) -> np.ndarray:
    """Raw GGUF Q4_0 / Q4_1 / Q8_0 blocks [rows, cols/32 * block bytes]: random codes, finite fp16
    scales in [-scale, scale]."""
    rng = np.random.default_rng(seed)
    nb = cols // 32
    fp16 = lambda: rng.uniform(-scale, scale, (rows, nb, 1)).astype(np.float16).view(np.uint8)  # noqa: E731
    if kind == "Q8_0":
        parts = [fp16(), rng.integers(-128, 128, (rows, nb, 32), dtype=np.int8).view(np.uint8)]
    elif kind == "Q4_1":
        parts = [fp16(), fp16(), rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)]
    else:  # Q4_0
        parts = [fp16(), rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def random_kquant_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw GGUF K-quant blocks [rows, cols / 256 * block bytes]: random codes and scales."""
    from chatloom.bench.kquant_matmul import random_blocks

    return random_blocks(kind, rows, cols, seed)


def dequantize(kind: str, blocks: np.ndarray) -> torch.Tensor:
    """gguf's own dequantizer (the reference every K-quant path must equal)."""
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float32))


# A Q4_K_M-like mix: Q4_K for most, Q6_K for values, the MLP's down projection and the head.
KQUANT_MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
              "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K"}


def write_kquant_gguf(path: Path, cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GGUF file like write_gguf's but with its matrices in K-quant types (KQUANT_MIX);
    returns the weights gguf dequantizes them to, in Hugging Face naming (the reference)."""
    import gguf

    weights = random_weights(cfg, seed)
    ref: dict[str, torch.Tensor] = {}
    blocks: dict[str, tuple[str, np.ndarray]] = {}
    for i, (name, t) in enumerate(weights.items()):
        gname = _GGUF_GLOBAL.get(name) or "blk.{}.{}.{}".format(
            name.split(".")[2], _GGUF_LAYER[".".join(name.split(".")[3:-1])], name.split(".")[-1])
        stem = gname.split(".")[-2] if gname.startswith("blk.") else gname.split(".")[0]
        kind = KQUANT_MIX.get(stem)
        if kind is None or t.dim() != 2:
            ref[name] = t
            continue
        raw = random_kquant_blocks(kind, t.shape[0], t.shape[1], seed * 100 + i)
        blocks[gname] = (kind, raw)
        ref[name] = dequantize(kind, raw)
        if cfg["model_type"] in ("llama", "mistral") and stem in ("attn_q", "attn_k"):
            # The file holds llama.cpp's permuted rows; Hugging Face's order is the inverse.
            heads = cfg["num_attention_heads"] if stem == "attn_q" else cfg["num_key_value_heads"]
            out, inp = ref[name].shape
            ref[name] = ref[name].reshape(heads, out // heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)
    write_gguf(path, cfg, {n: t for n, t in ref.items()}, raw_blocks=blocks)
    return ref
