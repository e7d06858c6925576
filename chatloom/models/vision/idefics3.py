"""Idefics3 / SmolVLM: a SigLIP encoder, a pixel-shuffle connector, a Llama-family decoder.

The decoder is chatloom's own (llama.py) built from `text_config`; this file holds the image side:
`Idefics3Vision` turns an image's tiles into one embedding per image token, in the order the prompt's
image tokens come (`prompt_text`), and knows how many tokens an image of a given size becomes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from PIL import Image

from chatloom.models.config import ModelConfig, ModelError
from chatloom.models.hf_config import VISION_LANGUAGE, config_from_hf
from chatloom.models.vision.idefics3_processor import Idefics3ImageProcessor, PreparedImage, prompt_text
from chatloom.models.vision.siglip import SiglipConfig, SiglipVisionTransformer
from chatloom.models.vision.weights import load_named

VISION_ARCHITECTURES = VISION_LANGUAGE
IMAGE_TOKEN = "<image>"


@dataclass
class Idefics3Config:
    text: ModelConfig
    vision: SiglipConfig
    scale_factor: int
    image_token_id: int
    extra: dict = field(default_factory=dict)

    @property
    def image_seq_len(self) -> int:
        """Image tokens per tile: the encoder's patches after the pixel shuffle."""
        return self.vision.patches_per_side ** 2 // self.scale_factor ** 2

    def vision_parameters(self) -> int:
        """The encoder's and the connector's parameters (the decoder's are text.num_parameters())."""
        return self.vision.num_parameters() + self.vision.hidden_size * self.scale_factor ** 2 * self.text.hidden_size

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "model") -> "Idefics3Config":
        text_cfg, vision_cfg = cfg.get("text_config"), cfg.get("vision_config")
        if not isinstance(text_cfg, dict) or not isinstance(vision_cfg, dict):
            raise ModelError("an Idefics3 config.json needs text_config and vision_config objects")
        text = config_from_hf(cfg, name=name)  # the decoder, from text_config
        # The head is read from lm_head.weight when the checkpoint has one, else from the embeddings.
        text.tie_word_embeddings = False
        vision = SiglipConfig.from_hf(vision_cfg)
        scale = int(cfg.get("scale_factor", 2))
        if scale < 1 or vision.patches_per_side % scale:
            raise ModelError(f"scale_factor {scale} does not divide the {vision.patches_per_side} patches per side")
        if "image_token_id" not in cfg:
            raise ModelError("config.json lacks image_token_id")
        return cls(text, vision, scale, int(cfg["image_token_id"]))


class Idefics3Vision(nn.Module):
    """The image side of the model: tiles in, decoder embeddings out."""

    def __init__(self, cfg: Idefics3Config, processor: Idefics3ImageProcessor) -> None:
        super().__init__()
        self.config = cfg
        self.processor = processor
        self.vision_model = SiglipVisionTransformer(cfg.vision)
        self.proj = nn.Linear(cfg.vision.hidden_size * cfg.scale_factor ** 2, cfg.text.hidden_size, bias=False)
        if processor.tile != cfg.vision.image_size:
            raise ModelError(f"the image processor's tile ({processor.tile}) is not the encoder's image size "
                             f"({cfg.vision.image_size})")

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[tiles, side*side, D] -> [tiles, side*side/s^2, D*s^2]: each s x s block of patches becomes
        one token (the same order as transformers' connector)."""
        b, seq, d = x.shape
        s, side = self.config.scale_factor, int(seq ** 0.5)
        x = x.view(b, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(b, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return x.reshape(b, seq // (s * s), d * s * s)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's tiles [tiles, 3, H, W] -> its embeddings [tiles * image_seq_len, text hidden]."""
        hidden = self.vision_model.embeddings(pixel_values.to(self.proj.weight.dtype))
        return self.finish_pieces(self.run_layers(hidden, 0, self.encoder_layers))

    def prompt_for(self, image: Image.Image) -> str:
        """The text that stands for `image` in the prompt (tags and image tokens, tile by tile)."""
        rows, cols = self.processor.grid(image.width, image.height)
        return prompt_text(rows, cols, self.config.image_seq_len)

    def num_image_tokens(self, width: int, height: int) -> int:
        """Image tokens an image of this size becomes (its embeddings; the tags around them aside)."""
        rows, cols = self.processor.grid(width, height)
        return (rows * cols + 1) * self.config.image_seq_len

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        return torch.from_numpy(self.processor(image).pixel_values)

    # Encoder work in pieces (the engine schedules them across steps): a piece is one tile, encoded on
    # its own by SigLIP and the connector, giving that tile's run of image tokens. A piece's encoder
    # layers may run in slices across steps: `embed_pieces`, then `run_layers` over consecutive ranges,
    # then `finish_pieces`; encode_pieces is the three at once.
    @property
    def piece_tokens(self) -> int:
        """Embeddings one piece gives: a tile's image tokens."""
        return self.config.image_seq_len

    @property
    def encoder_layers(self) -> int:
        return len(self.vision_model.layers)

    @property
    def state_bytes(self) -> int:
        """One piece's hidden state between layers: a tile's patches x the encoder's width."""
        v = self.config.vision
        return v.patches_per_side ** 2 * v.hidden_size * self.proj.weight.element_size()

    def prepare(self, image: Image.Image) -> PreparedImage:
        """What `embed_pieces` reads: the image resized for its tiles, done once per image."""
        return self.processor.prepare(image)

    @torch.inference_mode()
    def embed_pieces(self, prepared: PreparedImage, indices: list[int]) -> torch.Tensor:
        """Tiles `indices` of a prepared image -> their hidden state before the first layer [tiles, patches, D]."""
        pixels = torch.from_numpy(np.stack([self.processor.tile_pixels(prepared, i) for i in indices]))
        return self.vision_model.embeddings(pixels.to(self.proj.weight.dtype))

    @torch.inference_mode()
    def run_layers(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return self.vision_model.run_layers(hidden, start, stop)

    @torch.inference_mode()
    def finish_pieces(self, hidden: torch.Tensor) -> torch.Tensor:
        """The state after the last layer -> the pieces' embeddings [tiles * piece_tokens, text hidden]:
        the final LayerNorm, the pixel shuffle, the connector."""
        feats = self.vision_model.post_layernorm(hidden)
        return self.proj(self.pixel_shuffle(feats)).reshape(-1, self.config.text.hidden_size)

    def encode_pieces(self, prepared: PreparedImage, indices: list[int]) -> torch.Tensor:
        """Tiles `indices` of a prepared image, encoded together -> [len(indices) * piece_tokens, hidden]."""
        return self.finish_pieces(self.run_layers(self.embed_pieces(prepared, indices), 0, self.encoder_layers))

    def load(self, names: dict[str, str], get: Callable[[str], torch.Tensor | None],
             dtype: torch.dtype) -> "Idefics3Vision":
        """Fill the weights: `names` maps ours to the file's (a checkpoint's or a projector file's)."""
        load_named(self, names, get, dtype)
        return self.eval().requires_grad_(False)


def build_vision(cfg, folder: Path, get: Callable[[str], torch.Tensor | None], dtype: torch.dtype):
    """The image side of a vision-language folder with its weights from `get` (checkpoint names):
    Idefics3Vision for an Idefics3Config, LlavaVision for a LlavaConfig (models/vision/llava.py)."""
    if not isinstance(cfg, Idefics3Config):
        from chatloom.models.vision.llava import build_llava_vision
        return build_llava_vision(cfg, folder, get, dtype)
    vision = Idefics3Vision(cfg, Idefics3ImageProcessor.from_folder(folder))
    names = SiglipVisionTransformer.weight_names(cfg.vision, "model.vision_model.")
    names = {f"vision_model.{k}": v for k, v in names.items()}
    names["proj.weight"] = "model.connector.modality_projection.proj.weight"
    return vision.load(names, get, dtype)


def text_weight_getter(get: Callable[[str], torch.Tensor | None]) -> Callable[[str], torch.Tensor | None]:
    """The decoder's weights under the names build_model reads (model.layers..., lm_head), from an
    Idefics3 checkpoint (model.text_model.*) or a LLaVA one."""
    if get("model.text_model.embed_tokens.weight") is None:
        from chatloom.models.vision.llava import llava_text_getter
        return llava_text_getter(get)

    def text_get(name: str) -> torch.Tensor | None:
        if name.startswith("model."):
            return get("model.text_model." + name[len("model."):])
        return get(name)
    return text_get
