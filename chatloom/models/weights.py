"""Turn per-tensor weights (in Hugging Face naming) into a ready LlamaForCausalLM."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping

import torch

from chatloom.models.packed_linear import QuantizedWeight, pack_linears
from chatloom.models.config import ModelConfig, ModelError
from chatloom.models.llama import LlamaForCausalLM

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


def _expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The shape a Hugging Face-named weight must have under `cfg` (None: not checked here)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    stem = ".".join(name.split(".")[-2:])  # e.g. "q_proj.weight"
    return {
        "embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "norm.weight": (h,),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
        "o_proj.weight": (h, q), "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "gate_proj.weight": (i, h), "up_proj.weight": (i, h), "down_proj.weight": (h, i),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }.get(stem)


def linear_sources(cfg: ModelConfig, has_head: bool) -> dict[str, list[str]]:
    """Each linear layer of the model (by module name) and the Hugging Face weights it
    is made of, in order (QKV and gate/up are fused)."""
    out = {"lm_head": ["lm_head.weight" if has_head else "model.embed_tokens.weight"]}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.self_attn.qkv_proj"] = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        out[f"layers.{i}.self_attn.o_proj"] = [p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.mlp.gate_up_proj"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        out[f"layers.{i}.mlp.down_proj"] = [p + "mlp.down_proj.weight"]
    return out


def build_model(cfg: ModelConfig, get: WeightGetter, dtype: torch.dtype,
                quantized: Mapping[str, QuantizedWeight] | None = None,
                int8_matmul: bool | None = None, bf16_matmul: bool | None = None) -> LlamaForCausalLM:
    """Create the model and fill every parameter from `get`, fusing QKV and gate/up.

    `quantized` holds the GGUF-quantized form of weights (by Hugging Face name); in a
    float32 model, layers whose weights are all there keep them quantized, and multiply with
    int8 activations when `int8_matmul`; `bf16_matmul` keeps every layer's weight in bfloat16
    instead (see pack_linears)."""
    with _no_init():
        model = LlamaForCausalLM(cfg)

    def need(name: str) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise ModelError(f"weight {name!r} is missing from the model file")
        want = _expected_shape(cfg, name)
        if want is not None and tuple(t.shape) != want:
            # Checked before fusing: torch.cat would fail with a bare RuntimeError.
            raise ModelError(f"weight {name} has shape {tuple(t.shape)}, expected {want} "
                             "(the weights do not match the model's config)")
        return t

    state: dict[str, torch.Tensor] = {
        "embed_tokens.weight": need("model.embed_tokens.weight"),
        "norm.weight": need("model.norm.weight"),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        att = p + "self_attn."
        state[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [need(att + f"{n}_proj.weight") for n in "qkv"])
        if cfg.attention_bias:
            state[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                [need(att + f"{n}_proj.bias") for n in "qkv"])
        state[f"layers.{i}.self_attn.o_proj.weight"] = need(att + "o_proj.weight")
        state[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [need(p + "mlp.gate_proj.weight"), need(p + "mlp.up_proj.weight")])
        state[f"layers.{i}.mlp.down_proj.weight"] = need(p + "mlp.down_proj.weight")
        state[f"layers.{i}.input_layernorm.weight"] = need(p + "input_layernorm.weight")
        state[f"layers.{i}.post_attention_layernorm.weight"] = need(p + "post_attention_layernorm.weight")
    if not cfg.tie_word_embeddings:
        head = get("lm_head.weight")
        state["lm_head.weight"] = head if head is not None else state["embed_tokens.weight"]

    shapes = {k: v.shape for k, v in model.state_dict().items()}
    expected = {k for k in shapes if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    for name, tensor in state.items():
        want = shapes[name]
        if tuple(tensor.shape) != tuple(want):
            raise ModelError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(want)}")
    missing = expected - set(state)
    if missing:
        raise ModelError(f"weights missing: {sorted(missing)[:3]}")

    model = model.to_empty(device="cpu")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Buffers (RoPE tables) were created on meta: rebuild them for real.
    from chatloom.models.llama import RotaryEmbedding
    model.rope = RotaryEmbedding(cfg)
    model = model.eval().requires_grad_(False)
    if dtype == torch.float32:  # the C++ matmul, where it could be built
        quantized = quantized or {}
        sources = linear_sources(cfg, has_head=get("lm_head.weight") is not None)
        pack_linears(model, {module: [quantized[n] for n in names] for module, names in sources.items()
                             if all(n in quantized for n in names)}, int8_activations=int8_matmul,
                     bf16_weights=bf16_matmul)
    return model


def random_model(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0,
                 bf16_matmul: bool | None = None) -> LlamaForCausalLM:
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
