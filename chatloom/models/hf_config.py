"""Read a Hugging Face config.json into a ModelConfig, for every supported family.

Each family states the same things its own way (rope_scaling or rope_parameters, hidden_act
or hidden_activation, layer_types or a sliding-window pattern, num_local_experts or
num_experts); this file is where those spellings meet, with transformers' defaults where a
key is absent. No torch here: `chatloom capacity` reads configs without it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chatloom.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelError, RopeScaling

_GEMMA = ("gemma2", "gemma3_text")
# Vision-language families with a Llama-family text_config: Idefics3 / SmolVLM, LLaVA.
VISION_LANGUAGE = ("idefics3", "smolvlm", "llava")
# transformers' LlamaConfig defaults, which the hub's LLaVA configs lean on (llava-1.5-7b-hf's
# text_config names little more than its vocabulary).
_LLAMA_DEFAULTS = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
                       rms_norm_eps=1e-6)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _rope(cfg: dict, model_type: str) -> tuple[float, RopeScaling, float | None]:
    """(base, scaling) of the full-attention layers, and Gemma 3's base of its sliding ones."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    local_theta = None
    if model_type == "gemma3_text":
        full = params.get("full_attention") if isinstance(params.get("full_attention"), dict) else {}
        local = params.get("sliding_attention") if isinstance(params.get("sliding_attention"), dict) else {}
        if local.get("rope_type", "default") != "default":
            raise ModelError(f"RoPE scaling {local['rope_type']!r} on sliding-window layers is not supported")
        local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)
        theta = float(full.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0)
        scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else full
        return theta, RopeScaling.from_hf(scaling), local_theta
    scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else params
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    return theta, RopeScaling.from_hf(scaling), local_theta


def _layer_windows(cfg: dict, model_type: str, layers: int) -> list[int | None] | None:
    """Each layer's attention window, from layer_types or the family's own pattern."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        sliding = [t == "sliding_attention" for t in types]
    elif model_type == "gemma2":
        sliding = [(i + 1) % 2 == 1 for i in range(layers)]
    elif model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    elif model_type in ("mistral", "mixtral", "phi3"):
        sliding = [True] * layers
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
        first = int(cfg.get("max_window_layers", 28))
        sliding = [bool(cfg.get("use_sliding_window")) and i >= first for i in range(layers)]
    elif model_type == "qwen2_moe":
        first = int(cfg.get("max_window_layers", 28))
        sliding = [bool(cfg.get("use_sliding_window")) and (i + 1) % 2 == 1 and i < first for i in range(layers)]
    else:
        sliding = [False] * layers
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None  # transformers ignores the window unless use_sliding_window
    if window is None or not any(sliding):
        return None
    window = int(window)
    if window < 1:
        raise ModelError(f"config.json has a bad sliding_window {window}")
    return [window if s else None for s in sliding]


def _moe(cfg: dict, model_type: str, layers: int) -> dict[str, Any]:
    if model_type == "mixtral":
        return dict(num_experts=int(cfg.get("num_local_experts", 8)),
                    num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = int(cfg.get("decoder_sparse_step", 1))
        only_mlp = set(cfg.get("mlp_only_layers") or [])
        experts = int(cfg.get("num_experts", 60 if model_type == "qwen2_moe" else 128))
        return dict(num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 4)),
                    moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1408)),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0))
                    if model_type == "qwen2_moe" else 0,
                    moe_layers=[i not in only_mlp and experts > 0 and (i + 1) % step == 0 for i in range(layers)])
    return {}


def config_from_hf(cfg: dict, name: str = "model") -> ModelConfig:
    """Build from a Hugging Face config.json dictionary."""
    model_type = cfg.get("model_type", "")
    if model_type in VISION_LANGUAGE and isinstance(cfg.get("text_config"), dict):
        # A vision-language model's decoder (its image side is models/vision/): what the KV cache,
        # the context window and `chatloom capacity` are about.
        text = cfg["text_config"]
        base = {"model_type": "llama", "rms_norm_eps": 1e-5}
        if model_type == "llava" and text.get("model_type", "llama") == "llama":
            base = _LLAMA_DEFAULTS
        return config_from_hf({**base, **text}, name)
    if model_type == "gemma3" and isinstance(cfg.get("text_config"), dict):
        raise ModelError("Gemma 3 vision-language checkpoints are not supported; use a text-only "
                         "(gemma3_text) checkpoint such as Gemma 3 1B")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        raise ModelError(f"activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    if cfg.get("mlp_bias"):
        raise ModelError("MLP biases (mlp_bias) are not supported")
    if float(cfg.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ModelError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    gemma = model_type in _GEMMA
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        trained = int(cfg.get("max_position_embeddings", 2048))
        theta, scaling, local_theta = _rope(cfg, model_type)
        scalar = cfg.get("query_pre_attn_scalar", 256 if gemma else None)
        bias_default = model_type == "qwen2"
        if model_type == "qwen2_moe":
            bias = bool(cfg.get("qkv_bias", True))
        else:
            bias = bool(cfg.get("attention_bias", bias_default))
        return ModelConfig(
            architecture=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            max_position=scaling.context_length(trained),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if gemma else 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_trained_max_position=trained,
            rope_local_theta=local_theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            sandwich_norms=gemma,
            hidden_act=_ACTIVATIONS[act],
            embedding_scale=hidden ** 0.5 if gemma else None,
            attn_softcap=float(cfg["attn_logit_softcapping"]) if cfg.get("attn_logit_softcapping") else None,
            final_softcap=float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping") else None,
            attention_scale=float(scalar) ** -0.5 if scalar else None,
            layer_windows=_layer_windows(cfg, model_type, layers),
            name=name,
            **_moe(cfg, model_type, layers),
        )
    except KeyError as exc:
        raise ModelError(f"config.json lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ModelError(f"config.json has a bad value: {exc}") from None


def read_config_file(path: Path) -> ModelConfig:
    """A config.json file (a model folder's, or one given alone)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelError(f"config {path} is not a JSON object")
    return config_from_hf(data, name=Path(path).stem)
