"""GGUF tensor names -> the Hugging Face names weights.py builds a model from, per family.

llama.cpp's converter renames every tensor (blk.N.attn_q, ...), reuses a few names with a
family's own meaning (Gemma's ffn_norm is the norm *before* the MLP, its post_attention_norm
the one after attention; Phi-3's ffn_up holds gate and up fused), and stacks each MoE
projection of all experts into one 3-D tensor (ffn_gate_exps [experts, rows, cols]). This
file undoes that: a stacked tensor becomes one 2-D weight per expert, each a view of its
rows, so quantized experts keep their blocks and reach the same matmul kernels as any layer.
The stems come from the gguf package's own tables, not hand-typed strings.
"""
from __future__ import annotations

from gguf.constants import MODEL_TENSOR as T, TENSOR_NAMES


def _stem(tensor: T) -> str:
    """The name part after "blk.{bid}." (or the whole name for global tensors)."""
    return TENSOR_NAMES[tensor].rsplit(".", 1)[-1]


_GLOBAL = {_stem(T.TOKEN_EMBD): "model.embed_tokens", _stem(T.OUTPUT_NORM): "model.norm",
           _stem(T.OUTPUT): "lm_head"}

# Per-layer stems shared by every family (Llama's meaning of ffn_norm: the norm before the MLP,
# which Hugging Face's Llama calls post_attention_layernorm).
_LAYER = {
    _stem(T.ATTN_Q): "self_attn.q_proj", _stem(T.ATTN_K): "self_attn.k_proj",
    _stem(T.ATTN_V): "self_attn.v_proj", _stem(T.ATTN_OUT): "self_attn.o_proj",
    _stem(T.ATTN_QKV): "self_attn.qkv_proj",
    _stem(T.ATTN_Q_NORM): "self_attn.q_norm", _stem(T.ATTN_K_NORM): "self_attn.k_norm",
    _stem(T.ATTN_NORM): "input_layernorm", _stem(T.FFN_NORM): "post_attention_layernorm",
    _stem(T.FFN_GATE): "mlp.gate_proj", _stem(T.FFN_UP): "mlp.up_proj", _stem(T.FFN_DOWN): "mlp.down_proj",
}
# Gemma 2/3: four norms per layer (FFN_PRE_NORM shares the ffn_norm stem).
_GEMMA = {_stem(T.ATTN_POST_NORM): "post_attention_layernorm",
          _stem(T.FFN_PRE_NORM): "pre_feedforward_layernorm",
          _stem(T.FFN_POST_NORM): "post_feedforward_layernorm"}
# Phi-3: gate and up stored fused in ffn_up (gate rows first, as Hugging Face's gate_up_proj).
_PHI3 = {_stem(T.FFN_UP): "mlp.gate_up_proj"}
# Mixture of experts: the router, the stacked experts, and Qwen2-MoE's shared expert.
_MIXTRAL = {_stem(T.FFN_GATE_INP): "block_sparse_moe.gate"}
_MIXTRAL_EXPERTS = {_stem(T.FFN_GATE_EXP): "w1", _stem(T.FFN_UP_EXP): "w3", _stem(T.FFN_DOWN_EXP): "w2"}
_QWEN_MOE = {_stem(T.FFN_GATE_INP): "mlp.gate", _stem(T.FFN_GATE_SHEXP): "mlp.shared_expert.gate_proj",
             _stem(T.FFN_UP_SHEXP): "mlp.shared_expert.up_proj",
             _stem(T.FFN_DOWN_SHEXP): "mlp.shared_expert.down_proj",
             _stem(T.FFN_GATE_INP_SHEXP): "mlp.shared_expert_gate"}
_QWEN_EXPERTS = {_stem(T.FFN_GATE_EXP): "gate_proj", _stem(T.FFN_UP_EXP): "up_proj",
                 _stem(T.FFN_DOWN_EXP): "down_proj"}
# Older Mixtral files keep one 2-D tensor per expert: blk.N.ffn_gate.E.weight.
_SPLIT_EXPERTS = {_stem(T.FFN_GATE): _stem(T.FFN_GATE_EXP), _stem(T.FFN_UP): _stem(T.FFN_UP_EXP),
                  _stem(T.FFN_DOWN): _stem(T.FFN_DOWN_EXP)}


def _layer_table(arch: str) -> tuple[dict[str, str], dict[str, str], str]:
    """(stem -> module, stacked-expert stem -> expert weight, experts prefix) for a family."""
    table = dict(_LAYER)
    if arch in ("gemma2", "gemma3_text"):
        table.update(_GEMMA)
    if arch == "phi3":
        table.update(_PHI3)
    if arch == "mixtral":
        table.update(_MIXTRAL)
        return table, _MIXTRAL_EXPERTS, "block_sparse_moe.experts"
    if arch in ("qwen2_moe", "qwen3_moe"):
        table.update(_QWEN_MOE)
        return table, _QWEN_EXPERTS, "mlp.experts"
    return table, {}, ""


def hf_names(arch: str, gguf_name: str, shape: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """The Hugging Face weights a GGUF tensor holds, for family `arch` (a model_type): each
    name with the index of its slice along the tensor's first axis (None: the whole tensor).
    Empty for tensors the model does not use (rope_freqs, read as metadata)."""
    parts = gguf_name.split(".")
    if parts[0] != "blk":
        stem = _GLOBAL.get(parts[0])
        return [(f"{stem}.{parts[-1]}", None)] if stem and len(parts) == 2 else []
    if len(parts) < 4 or not parts[1].isdigit():
        return []
    prefix = f"model.layers.{parts[1]}."
    table, experts, experts_prefix = _layer_table(arch)
    if len(parts) == 5 and parts[3].isdigit() and experts:  # blk.N.ffn_gate.E.weight
        stacked = _SPLIT_EXPERTS.get(parts[2])
        if stacked is None:
            return []
        return [(f"{prefix}{experts_prefix}.{parts[3]}.{experts[stacked]}.{parts[4]}", None)]
    if len(parts) != 4:
        return []
    if parts[2] in experts:
        if len(shape) != 3:
            return []
        return [(f"{prefix}{experts_prefix}.{e}.{experts[parts[2]]}.{parts[3]}", e) for e in range(shape[0])]
    module = table.get(parts[2])
    return [(f"{prefix}{module}.{parts[3]}", None)] if module else []
