"""The CLIP vision transformer as LLaVA uses it: a class token and patch embeddings with learned
positions, a LayerNorm before the encoder, pre-norm layers with a quick-GELU MLP, read at one layer's
output (LLaVA-1.5: the second to last). The layers after that one are never run nor loaded.
"""
from __future__ import annotations

import torch
from torch import nn

from chatloom.models.config import ModelError
from chatloom.models.vision.siglip import SiglipConfig, SiglipLayer

# transformers' CLIPVisionConfig defaults: the hub's LLaVA configs leave most keys out.
CLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     image_size=224, patch_size=32, layer_norm_eps=1e-5, hidden_act="quick_gelu")


def clip_config(cfg: dict) -> SiglipConfig:
    """A CLIP vision_config (missing keys take CLIP's defaults) as the encoder's shape."""
    return SiglipConfig.from_hf({**CLIP_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}})


def layers_to_run(cfg: SiglipConfig, feature_layer: int) -> int:
    """How many encoder layers produce hidden state `feature_layer` (transformers' hidden_states index:
    0 is the embeddings, -1 the last layer's output)."""
    index = feature_layer + cfg.num_layers + 1 if feature_layer < 0 else feature_layer
    if not 0 <= index <= cfg.num_layers:
        raise ModelError(f"vision_feature_layer {feature_layer} is outside the encoder's {cfg.num_layers} layers")
    return index


def clip_parameters(cfg: SiglipConfig, layers: int) -> int:
    """Parameters of the encoder up to `layers` layers (the rest are not loaded)."""
    d, i, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    embed = d + cfg.num_channels * p * p * d + (cfg.patches_per_side ** 2 + 1) * d + 2 * d
    layer = 4 * (d * d + d) + 2 * d * i + i + d + 4 * d
    return embed + layers * layer


class ClipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size, bias=False)
        self.position_embedding = nn.Embedding(cfg.patches_per_side ** 2 + 1, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [B, patches, D]
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        return torch.cat([cls, x], dim=1) + self.position_embedding.weight


class ClipVisionTransformer(nn.Module):
    """pixels [B, 3, S, S] -> the hidden state after `layers` layers [B, 1 + patches, D] (class token first)."""

    def __init__(self, cfg: SiglipConfig, layers: int) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = ClipEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(layers))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.run_layers(self.embed(pixels), 0, len(self.layers))

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels -> the hidden state before the first layer."""
        return self.pre_layrnorm(self.embeddings(pixels))

    def run_layers(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The hidden state through layers start..stop-1 (the encoder in slices: siglip.py)."""
        for layer in self.layers[start:stop]:
            x = layer(x)
        return x

    @staticmethod
    def weight_names(layers: int, prefix: str) -> dict[str, str]:
        """Our parameter names and a Hugging Face checkpoint's (under `prefix`)."""
        names = {f"embeddings.{n}": f"{prefix}embeddings.{n}" for n in
                 ("class_embedding", "patch_embedding.weight", "position_embedding.weight")}
        names.update({f"pre_layrnorm.{p}": f"{prefix}pre_layrnorm.{p}" for p in ("weight", "bias")})
        for i in range(layers):
            me, hf = f"layers.{i}.", f"{prefix}encoder.layers.{i}."
            for n in ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.out_proj"):
                for p in ("weight", "bias"):
                    names[f"{me}{n}.{p}"] = f"{hf}{n}.{p}"
            for n in ("fc1", "fc2"):
                for p in ("weight", "bias"):
                    names[f"{me}{n}.{p}"] = f"{hf}mlp.{n}.{p}"
        return names
