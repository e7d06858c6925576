"""The SigLIP vision transformer as Idefics3 / SmolVLM use it: patch embedding, learned positions
bucketed for any tile size (NaViT-style), pre-norm encoder layers with a GELU MLP, a final LayerNorm.

Tiles of one image are all full (the processor resizes to whole tiles), so attention needs no mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from chatloom.models.config import ModelError

# The encoders' MLP activations by their config names (CLIP's quick_gelu: x * sigmoid(1.702 x)).
_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
         "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


@dataclass
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    num_channels: int = 3

    @classmethod
    def from_hf(cls, cfg: dict) -> "SiglipConfig":
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTS:
            raise ModelError(f"vision activation {act!r} is not supported ({', '.join(_ACTS)})")
        try:
            out = cls(hidden_size=int(cfg.get("hidden_size", 1152)), intermediate_size=int(cfg.get("intermediate_size", 3072)),
                      num_layers=int(cfg.get("num_hidden_layers", 12)), num_heads=int(cfg.get("num_attention_heads", 16)),
                      image_size=int(cfg.get("image_size", 224)), patch_size=int(cfg.get("patch_size", 32)),
                      layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-6)), hidden_act=act,
                      num_channels=int(cfg.get("num_channels", 3)))
        except (TypeError, ValueError) as exc:
            raise ModelError(f"vision_config has a bad value: {exc}") from None
        if out.hidden_size % out.num_heads or out.image_size % out.patch_size:
            raise ModelError("vision_config: hidden_size must divide by the heads and image_size by patch_size")
        return out

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def num_parameters(self) -> int:
        d, i, p = self.hidden_size, self.intermediate_size, self.patch_size
        embed = self.num_channels * p * p * d + d + self.patches_per_side ** 2 * d
        layer = 4 * (d * d + d) + 2 * d * i + i + d + 4 * d
        return embed + self.num_layers * layer + 2 * d


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_side ** 2, cfg.hidden_size)

    def position_ids(self, rows: int, cols: int) -> torch.Tensor:
        """Each patch's learned position, its fractional place in the tile bucketed onto the trained
        grid (the identity for a tile of the trained size)."""
        side = self.cfg.patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side)

        def buckets(n: int) -> torch.Tensor:
            frac = torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(float(n)))
            return torch.bucketize(frac.clamp(max=1.0 - 1e-6), boundaries, right=True)
        return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).reshape(-1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels)  # [B, D, h, w]
        rows, cols = x.shape[-2:]
        return x.flatten(2).transpose(1, 2) + self.position_embedding(self.position_ids(rows, cols))


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.heads, d = cfg.num_heads, cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(o.transpose(1, 2).reshape(b, t, d))


class SiglipLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class SiglipVisionTransformer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [tiles, 3, H, W] -> patch features [tiles, patches, hidden]."""
        return self.post_layernorm(self.run_layers(self.embeddings(pixels), 0, len(self.layers)))

    def run_layers(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The hidden state [tiles, patches, hidden] through layers start..stop-1: the encoder run in
        slices, each continuing from the state the last one left, gives forward's result."""
        for layer in self.layers[start:stop]:
            x = layer(x)
        return x

    @staticmethod
    def weight_names(cfg: SiglipConfig, prefix: str) -> dict[str, str]:
        """Our parameter names and the checkpoint's (under `prefix`, e.g. "model.vision_model.")."""
        names = {f"embeddings.{n}": f"{prefix}embeddings.{n}" for n in
                 ("patch_embedding.weight", "patch_embedding.bias", "position_embedding.weight")}
        for i in range(cfg.num_layers):
            me, hf = f"layers.{i}.", f"{prefix}encoder.layers.{i}."
            for n in ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.out_proj"):
                for p in ("weight", "bias"):
                    names[f"{me}{n}.{p}"] = f"{hf}{n}.{p}"
            for n in ("fc1", "fc2"):
                for p in ("weight", "bias"):
                    names[f"{me}{n}.{p}"] = f"{hf}mlp.{n}.{p}"
        for p in ("weight", "bias"):
            names[f"post_layernorm.{p}"] = f"{prefix}post_layernorm.{p}"
        return names
