"""Architecture hyper-parameters of a Llama-family decoder, whatever file they came from."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Architectures whose decoder is the plain Llama block (RMSNorm, RoPE, GQA, SwiGLU).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


class ModelError(Exception):
    """A model cannot be found, read or run; the message names the problem for the user."""


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
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    name: str = "model"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
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

    def kv_bytes_per_token(self, dtype: str = "fp32") -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "model") -> "ModelConfig":
        """Build from a Hugging Face config.json dictionary."""
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelError(
                f"unsupported architecture {model_type!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        # transformers 5 writes rope_theta inside rope_parameters; older configs at the top level.
        rope_params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else {}
        rope_type = scaling.get("rope_type") or scaling.get("type") or rope_params.get("rope_type") or "default"
        if rope_type != "default":
            # llama3 / yarn / linear scaling change the RoPE frequencies at every position.
            raise ModelError(f"RoPE scaling {rope_type!r} is not supported yet (only plain RoPE)")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelError(f"activation {act!r} is not supported (the Llama MLP uses silu)")
        if cfg.get("mlp_bias"):
            raise ModelError("MLP biases (mlp_bias) are not supported")
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = int(cfg.get("head_dim") or hidden // num_heads)
            max_position = int(cfg.get("max_position_embeddings", 2048))
            # Within the sliding window, windowed attention is plain causal attention:
            # cap the context there rather than compute something else beyond it.
            window = cfg.get("sliding_window")
            if window and (model_type == "mistral" or cfg.get("use_sliding_window")):
                max_position = min(max_position, int(window))
            return cls(
                architecture=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                max_position=max_position,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                name=name,
            )
        except KeyError as exc:
            raise ModelError(f"config.json lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            raise ModelError(f"config.json has a bad value: {exc}") from None

    @classmethod
    def from_json_file(cls, path: Path) -> "ModelConfig":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read config {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ModelError(f"config {path} is not a JSON object")
        return cls.from_hf_dict(data, name=Path(path).stem)
