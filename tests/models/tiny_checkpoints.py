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


def hf_config(model_type: str = "llama", **overrides) -> dict:
    cfg = {"model_type": model_type, "architectures": [{"llama": "LlamaForCausalLM",
           "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]],
           "vocab_size": len(vocab_tokens()), "bos_token_id": None,
           "eos_token_id": vocab_tokens().index("<|im_end|>"), **BASE}
    if model_type == "qwen2":
        cfg["use_sliding_window"] = False
    if model_type == "mistral":
        cfg["sliding_window"] = None
    cfg.update(overrides)
    return cfg


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights in Hugging Face naming (biases on q/k/v for qwen2)."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def rnd(*shape: int, scale: float | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    w = {"model.embed_tokens.weight": rnd(v, h, scale=1.0), "model.norm.weight": 1 + rnd(h, scale=0.1)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w.update({
            p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
            p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
            p + "mlp.down_proj.weight": rnd(h, i),
            p + "input_layernorm.weight": 1 + rnd(h, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + rnd(h, scale=0.1),
        })
        if cfg["model_type"] == "qwen2":
            w.update({p + "self_attn.q_proj.bias": rnd(q, scale=0.1), p + "self_attn.k_proj.bias": rnd(kv, scale=0.1),
                      p + "self_attn.v_proj.bias": rnd(kv, scale=0.1)})
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
               "post_attention_layernorm": "ffn_norm"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def write_gguf(path: Path, cfg: dict, weights: dict[str, torch.Tensor], pre: str = "default") -> Path:
    """The same model as a GGUF file: F32 tensors, gpt2-style BPE tokenizer metadata
    (`pre` names the pre-tokenizer, as llama.cpp's tokenizer.ggml.pre does)."""
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


def transformers_model(folder: Path):
    """transformers' own implementation of the checkpoint in `folder`, in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.inference_mode()
def transformers_logits(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    return [model(torch.tensor([s])).logits[0].float() for s in seqs]
