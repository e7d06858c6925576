"""Turn per-tensor weights (in Hugging Face naming) into a ready decoder, for every family."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping

import torch

from chatloom.models.kernels import load_kernels
from chatloom.models.packed_linear import QuantizedWeight, kernels_can_pack, pack_linears, quantizable
from chatloom.models.panel_cache import PanelCache
from chatloom.models.config import ModelConfig, ModelError
from chatloom.models.llama import LlamaForCausalLM
from chatloom.models.quantized_embedding import QuantizedEmbedding, can_keep

# get(name) returns the tensor for a Hugging Face weight name, or None when absent.
WeightGetter = Callable[[str], "torch.Tensor | None"]


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Skip nn.init while building the module: every parameter is replaced right after.
    (Building on the meta device instead runs factory calls through torch._refs, whose
    first use imports torch._dynamo: about 3 s of start-up.) Parameters are left as
    uninitialized CPU memory, which the OS does not even commit until it is touched."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "trunc_normal_", "ones_", "zeros_", "constant_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


def _weight_sources(cfg: ModelConfig) -> dict[str, list[list[str]]]:
    """Each parameter of our model and the Hugging Face weights it is made of: a list of
    alternatives (the first whose weights are all present wins), each a list of weights
    concatenated along the output rows (QKV and gate/up are fused; Phi-3 ships them fused)."""
    out: dict[str, list[list[str]]] = {
        "embed_tokens.weight": [["model.embed_tokens.weight"]], "norm.weight": [["model.norm.weight"]]}
    for i in range(cfg.num_layers):
        p, me = f"model.layers.{i}.", f"layers.{i}."
        att = p + "self_attn."
        out[me + "self_attn.qkv_proj.weight"] = [[att + f"{n}_proj.weight" for n in "qkv"], [att + "qkv_proj.weight"]]
        if cfg.attention_bias:
            out[me + "self_attn.qkv_proj.bias"] = [[att + f"{n}_proj.bias" for n in "qkv"], [att + "qkv_proj.bias"]]
        out[me + "self_attn.o_proj.weight"] = [[att + "o_proj.weight"]]
        if cfg.qk_norm:
            out[me + "self_attn.q_norm.weight"] = [[att + "q_norm.weight"]]
            out[me + "self_attn.k_norm.weight"] = [[att + "k_norm.weight"]]
        norms = ["input_layernorm", "post_attention_layernorm"]
        if cfg.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for n in norms:
            out[me + n + ".weight"] = [[p + n + ".weight"]]
        if not cfg.is_moe(i):
            out[me + "mlp.gate_up_proj.weight"] = [[p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                                                   [p + "mlp.gate_up_proj.weight"]]
            out[me + "mlp.down_proj.weight"] = [[p + "mlp.down_proj.weight"]]
            continue
        mixtral = cfg.architecture == "mixtral"
        moe = p + ("block_sparse_moe." if mixtral else "mlp.")
        out[me + "mlp.gate.weight"] = [[moe + "gate.weight"]]
        for e in range(cfg.num_experts):
            ex = f"{moe}experts.{e}."
            gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            out[f"{me}mlp.experts.{e}.gate_up_proj.weight"] = [[ex + gate + ".weight", ex + up + ".weight"]]
            out[f"{me}mlp.experts.{e}.down_proj.weight"] = [[ex + down + ".weight"]]
        if cfg.shared_expert_intermediate_size:
            sh = moe + "shared_expert."
            out[me + "mlp.shared_expert.gate_up_proj.weight"] = [[sh + "gate_proj.weight", sh + "up_proj.weight"]]
            out[me + "mlp.shared_expert.down_proj.weight"] = [[sh + "down_proj.weight"]]
            out[me + "mlp.shared_expert_gate.weight"] = [[moe + "shared_expert_gate.weight"]]
    return out


def build_model(cfg: ModelConfig, get: WeightGetter, dtype: torch.dtype,
                quantized: Mapping[str, QuantizedWeight] | None = None,
                int8_matmul: bool = False, norm_offset: float = 0.0,
                bf16_matmul: bool = False, panel_cache: PanelCache | None = None) -> LlamaForCausalLM:
    """Create the model and fill every parameter from `get`, fusing QKV and gate/up.

    `quantized` holds the GGUF-quantized form of weights (by Hugging Face name); in a
    float32 model, layers whose weights are all there keep them quantized, and multiply with
    int8 activations when `int8_matmul` (see pack_linears); `bf16_matmul` keeps every layer's weight in
    bfloat16 instead. `norm_offset` is added to every
    RMSNorm weight (Gemma's checkpoints store w for a norm that multiplies by 1 + w). `panel_cache`
    keeps the super-block panels of K-quant layers between starts (panel_cache.py)."""
    with _no_init():
        model = LlamaForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def fill(key: str, options: list[list[str]]) -> list[str] | None:
        # Each weight is read (dequantized) once: a getter may expand blocks on every call.
        names, parts = None, []
        for option in options:
            parts = []
            for n in option:
                t = get(n)
                if t is None:
                    break
                parts.append(t)
            else:
                names = option
                break
        if names is None:
            return None
        want = shapes[key]
        for n, t in zip(names, parts):
            # Checked before fusing: torch.cat would fail with a bare RuntimeError.
            if t.dim() != len(want) or tuple(t.shape[1:]) != want[1:]:
                raise ModelError(f"weight {n} has shape {tuple(t.shape)}, expected (*, {', '.join(map(str, want[1:]))}) "
                                 "(the weights do not match the model's config)")
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        if tuple(tensor.shape) != want:
            raise ModelError(f"weight {' + '.join(names)} has shape {tuple(tensor.shape)}, expected {want} "
                             "(the weights do not match the model's config)")
        if norm_offset and key.endswith("norm.weight"):
            tensor = tensor.float() + norm_offset
        state[key] = tensor.to(dtype)  # at once: a bf16 load never holds every weight in float32
        return names

    state: dict[str, torch.Tensor] = {}
    chosen: dict[str, list[str]] = {}
    # Linear layers whose GGUF blocks the kernels will read as they are: their float32
    # weights are never built (the parameter stays uncommitted memory until replaced).
    quantized = (quantized or {}) if dtype == torch.float32 and kernels_can_pack(load_kernels()) else {}
    linear_keys = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    embedding = _kept_embedding(cfg, quantized, bf16_matmul)
    for key, options in _weight_sources(cfg).items():
        if key == "embed_tokens.weight" and embedding is not None:  # never expanded to a float32 table
            chosen[key] = [_EMBEDDING]
            continue
        if key in linear_keys:
            kept = next((o for o in options if all(n in quantized for n in o)), None)
            if kept and quantizable([quantized[n] for n in kept], shapes[key][1], shapes[key][0]):
                chosen[key] = kept
                continue
        names = fill(key, options)
        if names is None:
            raise ModelError(f"weight {options[0][0]!r} is missing from the model file")
        chosen[key] = names
    if not cfg.tie_word_embeddings:
        head = shapes["lm_head.weight"]
        kept = ["lm_head.weight"] if "lm_head.weight" in quantized else (
            ["model.embed_tokens.weight"] if "model.embed_tokens.weight" in quantized
            and get("lm_head.weight") is None else None)
        if kept and quantizable([quantized[kept[0]]], head[1], head[0]):
            chosen["lm_head.weight"] = kept
        else:
            chosen["lm_head.weight"] = fill("lm_head.weight", [["lm_head.weight"], ["model.embed_tokens.weight"]])

    # The RoPE tables were built by the constructor (nn.init does not touch them): kept out of to_empty,
    # which would leave them uninitialized, rather than computed a second time (a 128k-position model's
    # take about 1 s of CPU).
    ropes = model.rope, model.rope_local
    model.rope, model.rope_local = None, None
    model = model.to_empty(device="cpu")
    model.rope, model.rope_local = ropes
    model.load_state_dict(state, strict=False, assign=True)
    if embedding is not None:
        model.embed_tokens = QuantizedEmbedding(embedding.raw, embedding.kind, cfg.hidden_size)
    if cfg.tie_word_embeddings and embedding is not None:  # the head is packed from the same blocks below
        chosen["lm_head.weight"] = [_EMBEDDING]
    elif cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        chosen["lm_head.weight"] = ["model.embed_tokens.weight"]
    model = model.eval().requires_grad_(False)
    if dtype == torch.float32:  # the C++ matmul, where it could be built
        pack_linears(model, {key[: -len(".weight")]: [quantized[n] for n in names]
                             for key, names in chosen.items()
                             if key.endswith(".weight") and all(n in quantized for n in names)},
                     int8_activations=int8_matmul, bf16_weights=bf16_matmul, panel_cache=panel_cache)
    return model


_EMBEDDING = "model.embed_tokens.weight"


def _kept_embedding(cfg: ModelConfig, quantized: Mapping[str, QuantizedWeight],
                    bf16_matmul: bool) -> QuantizedWeight | None:
    """The embedding's blocks where lookups can read them as they are: a kind the kernels expand,
    and a head that does not need the float32 table (its own weight, or a tied head the matmul
    kernels keep in the same blocks; the bfloat16 mode packs the head from floats)."""
    emb = quantized.get(_EMBEDDING)
    if emb is None or not can_keep(emb.kind) or emb.cols != cfg.hidden_size or emb.rows != cfg.vocab_size:
        return None
    if cfg.tie_word_embeddings and (bf16_matmul or not quantizable([emb], cfg.hidden_size, cfg.vocab_size)):
        return None
    return emb


def random_model(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0,
                 bf16_matmul: bool = False) -> LlamaForCausalLM:
    """Random weights (for tests), reproducible from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.bias": (kv,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            scale = 1.0 if "embed" in name else shape[-1] ** -0.5
            tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float64).float() * scale
    return build_model(cfg, tensors.get, dtype, bf16_matmul=bf16_matmul)
