"""LLaVA (LlavaForConditionalGeneration, the LLaVA-1.5 shape): a CLIP vision encoder read at one layer,
a two-layer GELU MLP projector, a Llama-family decoder.

The decoder is chatloom's own (llama.py) built from `text_config`; this file holds the image side:
`LlavaVision` turns an image into one embedding per image token. With the "default" feature strategy
the class token is dropped, so an image becomes (image size / patch size)² tokens (576 for
LLaVA-1.5's 336-pixel CLIP with 14-pixel patches), all the same for any image size.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from PIL import Image

from chatloom.models.config import ModelConfig, ModelError
from chatloom.models.hf_config import config_from_hf
from chatloom.models.vision.llava_encoder import ClipVisionTransformer, clip_config, clip_parameters, layers_to_run
from chatloom.models.vision.llava_processor import ClipImageProcessor
from chatloom.models.vision.siglip import SiglipConfig
from chatloom.models.vision.weights import load_named

IMAGE_TOKEN = "<image>"
_PROJECTOR_ACTS = {"gelu": nn.GELU, "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh")}
# Where checkpoints keep each part: transformers 4.x and 5 save LLaVA under different prefixes.
_VISION_PREFIXES = ("vision_tower.vision_model.", "model.vision_tower.vision_model.", "vision_tower.",
                    "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


@dataclass
class LlavaConfig:
    text: ModelConfig
    vision: SiglipConfig
    feature_layer: int  # transformers' hidden_states index
    select_strategy: str  # "default" drops the class token, "full" keeps it
    image_token_id: int
    projector_act: str = "gelu"
    projector_bias: bool = True

    @property
    def vision_layers(self) -> int:
        """Encoder layers run (and loaded): those before the feature layer."""
        return layers_to_run(self.vision, self.feature_layer)

    @property
    def image_seq_len(self) -> int:
        """Image tokens per image."""
        return self.vision.patches_per_side ** 2 + (self.select_strategy == "full")

    def vision_parameters(self) -> int:
        """The encoder's (the layers run) and the projector's parameters."""
        d, h = self.vision.hidden_size, self.text.hidden_size
        projector = d * h + h * h + (2 * h if self.projector_bias else 0)
        return clip_parameters(self.vision, self.vision_layers) + projector

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "model") -> "LlavaConfig":
        text_cfg, vision_cfg = cfg.get("text_config"), cfg.get("vision_config")
        if not isinstance(text_cfg, dict) or not isinstance(vision_cfg, dict):
            raise ModelError("a LLaVA config.json needs text_config and vision_config objects")
        vision_type = vision_cfg.get("model_type", "clip_vision_model")
        if vision_type != "clip_vision_model":
            raise ModelError(f"LLaVA vision tower {vision_type!r} is not supported (clip_vision_model)")
        text = config_from_hf(cfg, name=name)
        text.tie_word_embeddings = False  # the head is read from lm_head when present (text_weight_getter)
        layer = cfg.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ModelError(f"vision_feature_layer {layer!r} is not supported (one layer, an integer)")
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ModelError(f"vision_feature_select_strategy {strategy!r} is not supported (default, full)")
        act = cfg.get("projector_hidden_act", "gelu")
        if act not in _PROJECTOR_ACTS:
            raise ModelError(f"projector_hidden_act {act!r} is not supported ({', '.join(_PROJECTOR_ACTS)})")
        token = cfg.get("image_token_index", cfg.get("image_token_id"))
        if not isinstance(token, int):
            raise ModelError("config.json lacks image_token_index")
        out = cls(text, clip_config(vision_cfg), layer, strategy, token, act,
                  bool(cfg.get("multimodal_projector_bias", True)))
        out.vision_layers  # checks the layer against the encoder's depth
        return out


class LlavaVision(nn.Module):
    """The image side of the model: an image in, decoder embeddings out."""

    def __init__(self, cfg: LlavaConfig, processor: ClipImageProcessor) -> None:
        super().__init__()
        self.config = cfg
        self.processor = processor
        side = cfg.vision.image_size
        if processor.output_size(side, side) != (side, side) or not processor.do_center_crop:
            raise ModelError(f"the image processor's output ({processor.crop_height} x {processor.crop_width}, "
                             f"center crop {processor.do_center_crop}) is not the encoder's {side} x {side}")
        self.vision_model = ClipVisionTransformer(cfg.vision, cfg.vision_layers)
        h = cfg.text.hidden_size
        self.linear_1 = nn.Linear(cfg.vision.hidden_size, h, bias=cfg.projector_bias)
        self.act = _PROJECTOR_ACTS[cfg.projector_act]()
        self.linear_2 = nn.Linear(h, h, bias=cfg.projector_bias)
        # A GGUF vocabulary may have no image token: the prompt then gets placeholders (prompt.py).
        self.image_token_in_vocab = True

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's pixels [1, 3, S, S] -> its embeddings [image tokens, text hidden]."""
        hidden = self.vision_model.embed(pixel_values.to(self.linear_1.weight.dtype))
        return self.finish_pieces(self.run_layers(hidden, 0, self.encoder_layers))

    def prompt_for(self, image: Image.Image) -> str:
        return IMAGE_TOKEN * self.config.image_seq_len

    def num_image_tokens(self, width: int, height: int) -> int:
        return self.config.image_seq_len

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        return torch.from_numpy(self.processor(image))

    # Encoder work in pieces, as the engine schedules it: one image is one piece (CLIP attends across
    # the whole image, so it has no independent parts). Its layers may run in slices across steps, as
    # Idefics3Vision's do: `embed_pieces`, `run_layers` over consecutive ranges, `finish_pieces`.
    @property
    def piece_tokens(self) -> int:
        return self.config.image_seq_len

    @property
    def encoder_layers(self) -> int:
        return len(self.vision_model.layers)

    @property
    def state_bytes(self) -> int:
        """One image's hidden state between layers: the class token and the patches x the encoder's width."""
        v = self.config.vision
        return (v.patches_per_side ** 2 + 1) * v.hidden_size * self.linear_1.weight.element_size()

    def prepare(self, image: Image.Image) -> torch.Tensor:
        return self.preprocess(image)

    @torch.inference_mode()
    def embed_pieces(self, prepared: torch.Tensor, indices: list[int]) -> torch.Tensor:
        if list(indices) != [0]:
            raise IndexError(f"a LLaVA image is one piece; asked for {indices}")
        return self.vision_model.embed(prepared.to(self.linear_1.weight.dtype))

    @torch.inference_mode()
    def run_layers(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return self.vision_model.run_layers(hidden, start, stop)

    @torch.inference_mode()
    def finish_pieces(self, hidden: torch.Tensor) -> torch.Tensor:
        """The state after the last layer run -> the image's embeddings: the feature selection and the projector."""
        if self.config.select_strategy == "default":
            hidden = hidden[:, 1:]
        return self.linear_2(self.act(self.linear_1(hidden))).reshape(-1, self.config.text.hidden_size)

    def encode_pieces(self, prepared: torch.Tensor, indices: list[int]) -> torch.Tensor:
        return self.finish_pieces(self.run_layers(self.embed_pieces(prepared, indices), 0, self.encoder_layers))

    def load(self, names: dict[str, str], get: Callable[[str], torch.Tensor | None], dtype: torch.dtype,
             convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> "LlavaVision":
        """Fill the weights: `names` maps ours to the file's, `convert` reshapes a file's tensor."""
        load_named(self, names, get, dtype, convert)
        return self.eval().requires_grad_(False)


def _prefix(get: Callable[[str], torch.Tensor | None], prefixes: tuple[str, ...], probe: str) -> str:
    for prefix in prefixes:
        if get(prefix + probe) is not None:
            return prefix
    raise ModelError(f"the checkpoint has no {probe} under any of {', '.join(prefixes)}")


def build_llava_vision(cfg: LlavaConfig, folder: Path, get: Callable[[str], torch.Tensor | None],
                       dtype: torch.dtype) -> LlavaVision:
    """The image side of a Hugging Face LLaVA folder, its weights from `get` (checkpoint names)."""
    vision = LlavaVision(cfg, ClipImageProcessor.from_folder(folder))
    names = ClipVisionTransformer.weight_names(cfg.vision_layers,
                                               _prefix(get, _VISION_PREFIXES, "embeddings.class_embedding"))
    names = {f"vision_model.{k}": v for k, v in names.items()}
    projector = _prefix(get, _PROJECTOR_PREFIXES, "linear_1.weight")
    for n in ("linear_1", "linear_2"):
        for p in ("weight", "bias") if cfg.projector_bias else ("weight",):
            names[f"{n}.{p}"] = f"{projector}{n}.{p}"
    return vision.load(names, get, dtype)


def llava_text_getter(get: Callable[[str], torch.Tensor | None]) -> Callable[[str], torch.Tensor | None]:
    """The decoder's weights under the names build_model reads, from either LLaVA layout
    (language_model.model.* and language_model.lm_head, or model.language_model.* and lm_head)."""
    old = get("language_model.model.embed_tokens.weight") is not None

    def text_get(name: str) -> torch.Tensor | None:
        if old:
            return get("language_model." + name)
        if name.startswith("model."):
            return get("model.language_model." + name[len("model."):])
        return get(name)
    return text_get
