"""How much memory a model's weights take in chatloom, for each way its file can be stored.

`chatloom capacity --weights` prints it for any config (a Hugging Face config.json, a GGUF
file, a shipped example), and the README's table comes from it. A GGUF file is planned the
way llama.cpp's quantizer writes one (its main rules: the head, or the tied embedding, in
Q6_K unless the file is Q8_0; Q4_K_M and Q5_K_M put the value and down projections of the
first and last eighth of the layers and every third one between in Q6_K, and a fused QKV in
Q5_K or Q6_K), then sized with the memory check's own rules (memory_check.gguf_weight_bytes),
so the figures are what the loader would hold. No torch here.
"""
from __future__ import annotations

from typing import NamedTuple

from chatloom.models.config import ModelConfig
from chatloom.models.memory_check import gguf_weight_bytes

FLOAT_TYPES = ("F32", "F16", "BF16")
FILE_TYPES = FLOAT_TYPES + ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0")
_BASE = {"Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q5_K_M": "Q5_K", "Q4_K_M": "Q4_K", "Q4_0": "Q4_0"}


class PlannedTensor(NamedTuple):
    """Stands in for gguf_loader.GGUFTensor: name, type and the stored shape (bytes last
    for block types), without any data."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M and Q5_K_M give Q6_K projections."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _matrices(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, shape in elements) of every tensor of cfg's GGUF layout."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = [("token_embd.weight", (cfg.vocab_size, h)), ("output_norm.weight", (h,))]
    if not cfg.tie_word_embeddings:
        out.append(("output.weight", (cfg.vocab_size, h)))
    norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if cfg.sandwich_norms else [])
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        out += [(b + n + ".weight", (h,)) for n in norms]
        if cfg.qk_norm:
            out += [(b + "attn_q_norm.weight", (cfg.head_dim,)), (b + "attn_k_norm.weight", (cfg.head_dim,))]
        if cfg.architecture == "phi3":
            out.append((b + "attn_qkv.weight", (q + 2 * kv, h)))
        else:
            out += [(b + "attn_q.weight", (q, h)), (b + "attn_k.weight", (kv, h)), (b + "attn_v.weight", (kv, h))]
        out.append((b + "attn_output.weight", (h, q)))
        if cfg.is_moe(i):
            e, mi = cfg.num_experts, cfg.moe_intermediate_size
            out += [(b + "ffn_gate_inp.weight", (e, h)), (b + "ffn_gate_exps.weight", (e, mi, h)),
                    (b + "ffn_up_exps.weight", (e, mi, h)), (b + "ffn_down_exps.weight", (e, h, mi))]
            si = cfg.shared_expert_intermediate_size
            if si:
                out += [(b + "ffn_gate_inp_shexp.weight", (h,)), (b + "ffn_gate_shexp.weight", (si, h)),
                        (b + "ffn_up_shexp.weight", (si, h)), (b + "ffn_down_shexp.weight", (h, si))]
        elif cfg.architecture == "phi3":
            out += [(b + "ffn_up.weight", (2 * cfg.intermediate_size, h)),
                    (b + "ffn_down.weight", (h, cfg.intermediate_size))]
        else:
            i_size = cfg.intermediate_size
            out += [(b + "ffn_gate.weight", (i_size, h)), (b + "ffn_up.weight", (i_size, h)),
                    (b + "ffn_down.weight", (h, i_size))]
    return out


def _type_of(name: str, shape: tuple[int, ...], cfg: ModelConfig, file_type: str) -> str:
    if file_type in FLOAT_TYPES:
        return file_type if len(shape) > 1 else "F32"
    if len(shape) == 1 or ".ffn_gate_inp" in name:  # norms and routers stay float32
        return "F32"
    base = _BASE[file_type]
    head = name == "output.weight" or (name == "token_embd.weight" and cfg.tie_word_embeddings)
    if head:
        return "Q8_0" if base == "Q8_0" else "Q6_K"
    stem = name.split(".")[-2] if name.startswith("blk.") else ""
    k_m = file_type in ("Q4_K_M", "Q5_K_M")
    if k_m and stem == "attn_qkv":
        return "Q5_K" if file_type == "Q4_K_M" else "Q6_K"
    if k_m and stem.startswith(("attn_v", "ffn_down")) and _more_bits(int(name.split(".")[1]), cfg.num_layers):
        return "Q6_K"
    return base


def planned_tensors(cfg: ModelConfig, file_type: str) -> list[PlannedTensor]:
    """The tensors of cfg as a `file_type` GGUF file (see the module docstring)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r} (known: {', '.join(FILE_TYPES)})")
    out = []
    for name, shape in _matrices(cfg):
        kind = GGMLQuantizationType[_type_of(name, shape, cfg, file_type)]
        block, size = GGML_QUANT_SIZES[kind]
        stored = shape if kind.name in FLOAT_TYPES else (*shape[:-1], -(-shape[-1] // block) * size)
        out.append(PlannedTensor(name, kind, stored))
    return out


def weight_bytes(cfg: ModelConfig, file_type: str, float_bytes: int = 4, keeps_quantized: bool = True) -> int:
    """Bytes the loader holds for cfg's weights stored as `file_type`: float types as
    `float_bytes` each, block types at their kernels' layout when `keeps_quantized` (a
    float32 model with the C++ kernels), else as floats too."""
    return gguf_weight_bytes(planned_tensors(cfg, file_type), float_bytes, keeps_quantized)
