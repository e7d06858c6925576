"""A GGUF decoder's image side from llama.cpp's projector file (`mmproj`), LLaVA's here.

llama.cpp splits a vision-language model in two GGUF files: the decoder (an ordinary text model) and the
vision encoder with its projector (general.architecture "clip"). `load_mmproj` reads clip.projector_type:
"idefics3" files (SmolVLM) are read by mmproj_idefics3.py, "mlp" files (LLaVA) here.

For LLaVA, llama.cpp's converter keeps only the encoder layers LLaVA reads (LLaVA-1.5: all but the
last) and drops the class token's output, so the image embeddings are the last stored layer's patch
outputs through mm.0, GELU, mm.2. The image is preprocessed as transformers' CLIPImageProcessor does
(shortest edge to the encoder's size, centre crop) with the file's mean and std.

The decoder's vocabulary may lack an image token (llama.cpp's own LLaVA files have none): the prompt
then holds placeholders at the image's places (prompt.py), which only the image embeddings fill.
"""
from __future__ import annotations

from pathlib import Path

import torch

from chatloom.models.config import ModelConfig, ModelError
from chatloom.models.tokenizer import TextTokenizer
from chatloom.models.vision.idefics3 import Idefics3Vision
from chatloom.models.vision.llava import LlavaConfig, LlavaVision
from chatloom.models.vision.llava_encoder import CLIP_DEFAULTS
from chatloom.models.vision.llava_processor import CLIP_MEAN, CLIP_STD, ClipImageProcessor
from chatloom.models.vision.mmproj_file import ProjectorFile, encoder_config
from chatloom.models.vision.mmproj_idefics3 import IDEFICS3_MARK, load_idefics3_mmproj


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


def load_mmproj(path: str | Path, text: ModelConfig, tokenizer: TextTokenizer,
                dtype: torch.dtype) -> LlavaVision | Idefics3Vision:
    """The image side of a GGUF decoder (`text`, `tokenizer`) from its llama.cpp projector file."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no such projector file: {path}")
    p = ProjectorFile(path)
    if p.value("general.architecture") != "clip" or not p.value("clip.has_vision_encoder", False):
        raise ModelError(f"{path.name} is not a vision projector file (general.architecture clip with a "
                         "vision encoder)")
    kind = p.kind
    if kind == "idefics3":
        return load_idefics3_mmproj(p, text, tokenizer, dtype)
    if kind != "mlp":
        raise ModelError(f"projector type {kind!r} in {path.name} is not supported (LLaVA's mlp, SmolVLM's "
                         "idefics3)")
    return _load_llava(p, text, tokenizer, dtype)


def _load_llava(p: ProjectorFile, text: ModelConfig, tokenizer: TextTokenizer, dtype: torch.dtype) -> LlavaVision:
    name = p.path.name
    if tokenizer.tokenizer.token_to_id(IDEFICS3_MARK) is not None:
        raise ModelError(f"{name} is a LLaVA (mlp) projector, but the decoder's vocabulary has Idefics3's "
                         f"{IDEFICS3_MARK}: give a SmolVLM decoder its idefics3 projector file")
    if "v.post_ln.weight" in p.tensors:
        raise ModelError(f"{name} keeps the encoder's final LayerNorm, which LLaVA's mlp projector does not "
                         "read; convert it with llama.cpp's LLaVA converter")
    vision = encoder_config(p, "gelu" if p.value("clip.use_gelu", False) else "quick_gelu",
                            CLIP_DEFAULTS["layer_norm_eps"])
    if p.out_width("mm.2.weight") != text.hidden_size:
        raise ModelError(f"the projector {name} does not fit the decoder (its output is not "
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
    """Give a loaded GGUF decoder (a LoadedModel) its image side from `path` (LLaVA's or SmolVLM's)."""
    if loaded.vision is not None:
        raise ModelError(f"model {loaded.id} already has an image encoder; --mmproj is for GGUF decoders")
    loaded.vision = load_mmproj(path, loaded.config, loaded.tokenizer, loaded.dtype)
