"""An Idefics3 / SmolVLM image side from llama.cpp's projector file (clip.projector_type "idefics3").

llama.cpp's converter writes SmolVLM's SigLIP encoder under `v.` (its final LayerNorm as v.post_ln),
the connector's one linear layer as mm.model.fc, the pixel shuffle's scale factor as
clip.vision.projector.scale_factor and the processor's size.longest_edge as
clip.vision.preproc_image_size; the tile is the encoder's image size. The image is then preprocessed
exactly as from a Hugging Face folder (idefics3_processor.py), with the file's mean and std.

Defaults where the file holds nothing: a scale factor of 2 (transformers' and llama.cpp's default), a
longest edge of one tile (what llama.cpp's converter writes for a folder without size.longest_edge: an
image becomes a single global view, no grid of tiles), SigLIP's mean and std of 0.5 and its LayerNorm
epsilon of 1e-6.

The image tokens (<image>, <fake_token_around_image>, <global-img>, <row_R_col_C>) must all be in the
decoder's own vocabulary: the prompt is written as text and tokenized by the GGUF tokenizer.
"""
from __future__ import annotations

import math

import torch

from chatloom.models.config import ModelConfig, ModelError
from chatloom.models.tokenizer import TextTokenizer
from chatloom.models.vision.idefics3 import IMAGE_TOKEN, Idefics3Config, Idefics3Vision
from chatloom.models.vision.idefics3_processor import Idefics3ImageProcessor
from chatloom.models.vision.mmproj_file import ProjectorFile, encoder_config
from chatloom.models.vision.siglip import SiglipConfig

# A token only Idefics3's vocabularies have: how a decoder is told apart from a LLaVA one.
IDEFICS3_MARK = "<fake_token_around_image>"
_TAGS = (IMAGE_TOKEN, IDEFICS3_MARK, "<global-img>")
_SIGLIP_MEAN_STD = (0.5, 0.5, 0.5)
_SIGLIP_EPS = 1e-6

_LAYER_NAMES = (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                ("self_attn.out_proj", "attn_out"), ("layer_norm1", "ln1"), ("layer_norm2", "ln2"),
                ("fc1", "ffn_up"), ("fc2", "ffn_down"))


def _names(vision: SiglipConfig) -> dict[str, str]:
    """Idefics3Vision's parameter names and the projector file's."""
    names = {"vision_model.embeddings.patch_embedding.weight": "v.patch_embd.weight",
             "vision_model.embeddings.patch_embedding.bias": "v.patch_embd.bias",
             "vision_model.embeddings.position_embedding.weight": "v.position_embd.weight",
             "proj.weight": "mm.model.fc.weight"}
    for p in ("weight", "bias"):
        names[f"vision_model.post_layernorm.{p}"] = f"v.post_ln.{p}"
        for i in range(vision.num_layers):
            for ours, theirs in _LAYER_NAMES:
                names[f"vision_model.layers.{i}.{ours}.{p}"] = f"v.blk.{i}.{theirs}.{p}"
    return names


def _check_vocabulary(tokenizer: TextTokenizer, name: str, max_side: int) -> int:
    """The image token's id; ModelError naming the first image token the decoder's vocabulary lacks."""
    wanted = list(_TAGS) + [f"<row_{r}_col_{c}>" for r in range(1, max_side + 1) for c in range(1, max_side + 1)]
    for token in wanted:
        if tokenizer.tokenizer.token_to_id(token) is None:
            raise ModelError(f"{name} is an Idefics3 (SmolVLM) projector, but the decoder's vocabulary lacks "
                             f"{token}: give it the SmolVLM decoder it was converted with")
    return tokenizer.tokenizer.token_to_id(IMAGE_TOKEN)


def _processor(p: ProjectorFile, vision: SiglipConfig) -> Idefics3ImageProcessor:
    longest = int(p.value("clip.vision.preproc_image_size", vision.image_size))
    if longest < 1:
        raise ModelError(f"the projector file {p.path.name} has clip.vision.preproc_image_size {longest}")
    mean = tuple(float(x) for x in p.value("clip.vision.image_mean", _SIGLIP_MEAN_STD))
    std = tuple(float(x) for x in p.value("clip.vision.image_std", _SIGLIP_MEAN_STD))
    if len(mean) != 3 or len(std) != 3:
        raise ModelError(f"the projector file {p.path.name} needs three image_mean and image_std values")
    return Idefics3ImageProcessor(tile=vision.image_size, longest_edge=longest, mean=mean, std=std)


def load_idefics3_mmproj(p: ProjectorFile, text: ModelConfig, tokenizer: TextTokenizer,
                         dtype: torch.dtype) -> Idefics3Vision:
    """The image side of a SmolVLM decoder (`text`, `tokenizer`) from its idefics3 projector file `p`."""
    name = p.path.name
    # llama.cpp's use_gelu is ggml's tanh-approximated GELU, SigLIP's own activation.
    vision = encoder_config(p, "gelu_pytorch_tanh" if p.value("clip.use_gelu", True) else "quick_gelu",
                            _SIGLIP_EPS)
    scale = int(p.value("clip.vision.projector.scale_factor", 2))
    if scale < 1 or vision.patches_per_side % scale:
        raise ModelError(f"the projector file {name}: scale factor {scale} does not divide the "
                         f"{vision.patches_per_side} patches per side")
    processor = _processor(p, vision)
    image_token = _check_vocabulary(tokenizer, name, math.ceil(processor.longest_edge / processor.tile))
    if p.out_width("mm.model.fc.weight") not in (None, text.hidden_size):
        raise ModelError(f"the projector {name} does not fit the decoder (its output is not "
                         f"{text.hidden_size} wide)")
    cfg = Idefics3Config(text, vision, scale, image_token)
    return Idefics3Vision(cfg, processor).load(_names(vision), p.tensor, dtype)
