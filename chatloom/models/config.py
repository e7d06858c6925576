"""Architecture hyper-parameters of a decoder, whatever file they came from.

One dataclass covers every supported family: the plain Llama block (Llama, Mistral, Qwen2),
and the switches the others add to it: query/key norms (Qwen3, Gemma 3), Gemma's sandwich
norms, GELU, embedding scaling, soft-capping and alternating sliding-window layers, and
Mixture-of-Experts feed-forward layers (Mixtral, Qwen MoE). Reading Hugging Face configs is
in hf_config.py, GGUF metadata in gguf_loader.py. No torch here: `chatloom capacity` reads
configs without it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text",
                           "mixtral", "qwen2_moe", "qwen3_moe")

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class ModelError(Exception):
    """A model cannot be found, read or run; the message names the problem for the user."""


@dataclass
class RopeScaling:
    """A RoPE scaling as a config states it (Hugging Face rope_scaling, GGUF rope.scaling.*).
    rope.py turns it into cos/sin tables."""

    type: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn (None: derived from the factor)
    mscale: float | None = None  # yarn, DeepSeek-style attention factor
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    # GGUF llama3 files store the per-frequency divisors instead of the llama3 parameters.
    freq_factors: list[float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ModelError(f"RoPE scaling {self.type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if self.type != "default" and not (isinstance(self.factor, (int, float)) and self.factor > 0):
            raise ModelError(f"RoPE scaling {self.type!r} needs a positive factor, got {self.factor!r}")

    @classmethod
    def from_hf(cls, params: dict | None) -> "RopeScaling":
        """From a Hugging Face rope_scaling / rope_parameters dictionary (None: plain RoPE)."""
        if not params:
            return cls()
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind == "default":
            return cls()
        get = params.get
        try:
            return cls(
                type=kind, factor=float(get("factor") or 0.0),
                original_max_position=int(get("original_max_position_embeddings"))
                if get("original_max_position_embeddings") else None,
                low_freq_factor=float(get("low_freq_factor", 1.0)),
                high_freq_factor=float(get("high_freq_factor", 4.0)),
                beta_fast=float(get("beta_fast") or 32.0), beta_slow=float(get("beta_slow") or 1.0),
                attention_factor=None if get("attention_factor") is None else float(get("attention_factor")),
                mscale=get("mscale"), mscale_all_dim=get("mscale_all_dim"),
                truncate=bool(get("truncate", True)),
            )
        except (TypeError, ValueError) as exc:
            raise ModelError(f"RoPE scaling {kind!r} has a bad parameter: {exc}") from None

    def context_length(self, max_position: int) -> int:
        """The positions the model can serve: the config's, or the original context times
        the factor where that is longer (configs differ on which one they state)."""
        if self.type == "default":
            return max_position
        original = self.original_max_position or max_position
        return max(max_position, int(original * self.factor))


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # GGUF conversions of llama models permute Q/K so RoPE rotates adjacent pairs;
    # Hugging Face checkpoints rotate the two halves of each head.
    rope_interleaved: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # max_position_embeddings as trained (dynamic NTK scales relative to it); None: max_position.
    rope_trained_max_position: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Qwen3 / Gemma 3: RMSNorm over each head of q and k before RoPE.
    qk_norm: bool = False
    # Gemma 2/3: norms after attention and after the MLP too, not only before them.
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # or "gelu_tanh" (Gemma)
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_softcap: float | None = None  # Gemma 2: tanh soft-capping of attention scores
    final_softcap: float | None = None  # Gemma 2: of the logits
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    # Per-layer attention window (None: full causal attention over the whole context).
    layer_windows: list[int | None] | None = None
    # Gemma 3: sliding-window layers rotate with their own base (and no scaling).
    rope_local_theta: float | None = None
    # Mixture of experts: 0 experts means a dense MLP in every layer.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a gated always-on expert
    moe_layers: list[bool] | None = None  # which layers are MoE (None: all when num_experts)
    name: str = "model"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from to_dict() / JSON
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelError(
                f"unsupported architecture {self.architecture!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position")
        bad = [n for n in sizes if not isinstance(getattr(self, n), int) or getattr(self, n) < 1]
        if bad:
            raise ModelError(f"model config has invalid {', '.join(bad)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError("num_heads must be a multiple of num_kv_heads")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ModelError(f"activation {self.hidden_act!r} is not supported (silu, gelu_tanh)")
        if self.layer_windows is not None and len(self.layer_windows) != self.num_layers:
            raise ModelError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ModelError("mixture of experts needs 0 < experts per token <= experts "
                                 "and a positive expert size")
            if self.moe_layers is not None and len(self.moe_layers) != self.num_layers:
                raise ModelError(f"{len(self.moe_layers)} MoE layer flags for {self.num_layers} layers")

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def is_moe(self, layer: int) -> bool:
        return bool(self.num_experts) and (self.moe_layers is None or self.moe_layers[layer])

    def kv_bytes_per_token(self, dtype: str = "fp32") -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.attention_bias else 0)
        norms = (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        total = 0
        for layer in range(self.num_layers):
            if self.is_moe(layer):
                ffn = self.num_experts * (3 * h * self.moe_intermediate_size + h)
                if self.shared_expert_intermediate_size:
                    ffn += 3 * h * self.shared_expert_intermediate_size + h
            else:
                ffn = 3 * h * i
            total += attn + norms + ffn
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + total + h + head

    def to_dict(self) -> dict:
        return asdict(self)
