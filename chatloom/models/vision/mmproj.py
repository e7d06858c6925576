"""A LLaVA image side from llama.cpp's projector file (`mmproj`), beside a GGUF decoder.

llama.cpp splits a LLaVA model in two GGUF files: the decoder (an ordinary text model) and the CLIP
encoder with its projector (general.architecture "clip", clip.projector_type "mlp"). Its converter keeps
only the encoder layers LLaVA reads (LLaVA-1.5: all but the last) and drops the class token's output,
so the image embeddings are the last stored layer's patch outputs through mm.0, GELU, mm.2. The file's
names are read with the `gguf` package; the image is preprocessed as transformers' CLIPImageProcessor
does (shortest edge to the encoder's size, centre crop) with the file's mean and std.

The decoder's vocabulary may lack an image token (llama.cpp's own LLaVA files have none): the prompt
then holds placeholders at the image's places (prompt.py), which only the image embeddings fill.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatloom.models.config import ModelConfig, ModelError
from chatloom.models.vision.llava import LlavaConfig, LlavaVision
from chatloom.models.vision.llava_encoder import CLIP_DEFAULTS
from chatloom.models.vision.llava_processor import CLIP_MEAN, CLIP_STD, ClipImageProcessor
from chatloom.models.vision.siglip import SiglipConfig

_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16 (GGMLQuantizationType values)


class _Projector:
    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        try:
            self.reader = GGUFReader(str(path))
        except (OSError, ValueError, IndexError) as exc:
            raise ModelError(f"cannot read the projector file {path}: {exc}") from None
        self.path = path
        self.tensors = {t.name: t for t in self.reader.tensors}

    def value(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def tensor(self, name: str) -> torch.Tensor | None:
        t = self.tensors.get(name)
        if t is None:
            return None
        if int(t.tensor_type) in _FLOAT_TYPES:
            return torch.from_numpy(np.array(t.data, dtype=np.float32))
        from gguf.quants import dequantize

        return torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))


def _encoder_config(p: _Projector) -> SiglipConfig:
    def need(key: str) -> Any:
        v = p.value(f"clip.vision.{key}")
        if v is None:
            raise ModelError(f"the projector file {p.path.name} lacks clip.vision.{key}")
        return v
    return SiglipConfig(hidden_size=int(need("embedding_length")), intermediate_size=int(need("feed_forward_length")),
                        num_layers=int(need("block_count")), num_heads=int(need("attention.head_count")),
                        image_size=int(need("image_size")), patch_size=int(need("patch_size")),
                        layer_norm_eps=float(p.value("clip.vision.attention.layer_norm_epsilon",
                                                     CLIP_DEFAULTS["layer_norm_eps"])),
                        hidden_act="gelu" if p.value("clip.use_gelu", False) else "quick_gelu")


def _names(layers: int) -> dict[str, str]:
    names = {"vision_model.embeddings.class_embedding": "v.class_embd",
             "vision_model.embeddings.patch_embedding.weight": "v.patch_embd.weight",
             "vision_model.embeddings.position_embedding.weight": "v.position_embd.weight"}
    for p in ("weight", "bias"):
        names[f"vision_model.pre_layrnorm.{p}"] = f"v.pre_ln.{p}"
        names[f"linear_1.{p}"] = f"mm.0.{p}"
        names[f"linear_2.{p}"] = f"mm.2.{p}"
        for i in range(layers):
            me, blk = f"vision_model.layers.{i}.", f"v.blk.{i}."
            for ours, theirs in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                                 ("self_attn.v_proj", "attn_v"), ("self_attn.out_proj", "attn_out"),
                                 ("layer_norm1", "ln1"), ("layer_norm2", "ln2"), ("fc1", "ffn_up"),
                                 ("fc2", "ffn_down")):
                names[f"{me}{ours}.{p}"] = f"{blk}{theirs}.{p}"
    return names


def load_mmproj(path: str | Path, text: ModelConfig, tokenizer, dtype: torch.dtype) -> LlavaVision:
    """The image side of a LLaVA decoder (`text`, `tokenizer`) from its llama.cpp projector file."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no such projector file: {path}")
    p = _Projector(path)
    if p.value("general.architecture") != "clip" or not p.value("clip.has_vision_encoder", False):
        raise ModelError(f"{path.name} is not a vision projector file (general.architecture clip with a "
                         "vision encoder)")
    kind = p.value("clip.projector_type") or p.value("clip.vision.projector_type")
    if kind is None and p.value("clip.has_llava_projector", False):
        kind = "mlp"
    if kind != "mlp":
        raise ModelError(f"projector type {kind!r} in {path.name} is not supported (LLaVA's mlp)")
    if "v.post_ln.weight" in p.tensors:
        raise ModelError(f"{path.name} keeps the encoder's final LayerNorm, which LLaVA's mlp projector does not "
                         "read; convert it with llama.cpp's LLaVA converter")
    vision = _encoder_config(p)
    width = p.tensors.get("mm.2.weight")
    if width is None or int(width.shape[-1]) != text.hidden_size:
        raise ModelError(f"the projector {path.name} does not fit the decoder (its output is not "
                         f"{text.hidden_size} wide)")
    image_token = tokenizer.tokenizer.token_to_id("<image>")
    # Without one, the unknown token stands in: the text itself never tokenizes to it.
    placeholder = image_token if image_token is not None else tokenizer.tokenizer.token_to_id("<unk>") or 0
    cfg = LlavaConfig(text, vision, -1, "default", placeholder)
    side = vision.image_size
    processor = ClipImageProcessor(shortest_edge=side, crop_height=side, crop_width=side,
                                   mean=tuple(p.value("clip.vision.image_mean", CLIP_MEAN)),
                                   std=tuple(p.value("clip.vision.image_std", CLIP_STD)))
    out = LlavaVision(cfg, processor)
    out.image_token_in_vocab = image_token is not None
    return out.load(_names(vision.num_layers), p.tensor, dtype)


def attach_mmproj(loaded, path: str | Path) -> None:
    """Give a loaded GGUF decoder (a LoadedModel) its image side from `path`."""
    if loaded.vision is not None:
        raise ModelError(f"model {loaded.id} already has an image encoder; --mmproj is for GGUF decoders")
    loaded.vision = load_mmproj(path, loaded.config, loaded.tokenizer, loaded.dtype)
