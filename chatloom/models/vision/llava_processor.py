"""CLIP / LLaVA image preprocessing, the same pixel values as transformers' CLIPImageProcessor (and
LlavaImageProcessor, which may first pad the image to a square in the mean colour).

An image is converted to RGB (transparency over white), its shortest edge resized to `shortest_edge`
(bicubic by default; the other edge keeps the aspect ratio, truncated), cropped to `crop` x `crop`
around its centre (zero-padded where the image is smaller), rescaled to [0, 1] and normalized.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from chatloom.models.config import ModelError
from chatloom.models.vision.idefics3_processor import _RESAMPLE, _to_rgb

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _square(image: Image.Image, color: tuple[int, int, int]) -> Image.Image:
    side = max(image.width, image.height)
    if image.width == image.height:
        return image
    out = Image.new("RGB", (side, side), color)
    out.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return out


def _center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] cropped around its centre, zero-padded first where it is smaller (as transformers does)."""
    h, w = array.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return array[top:top + height, left:left + width]
    nh, nw = max(h, height), max(w, width)
    padded = np.zeros((nh, nw, array.shape[2]), dtype=array.dtype)
    pt, pl = -(-(nh - h) // 2), -(-(nw - w) // 2)
    padded[pt:pt + h, pl:pl + w] = array
    top, left = top + pt, left + pl
    return padded[max(top, 0):max(top, 0) + height, max(left, 0):max(left, 0) + width]


@dataclass
class ClipImageProcessor:
    shortest_edge: int = 224
    crop_height: int = 224
    crop_width: int = 224
    resample: Image.Resampling = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    do_resize: bool = True
    do_center_crop: bool = True
    do_normalize: bool = True
    pad_to_square: bool = False

    @classmethod
    def from_folder(cls, folder: Path) -> "ClipImageProcessor":
        path = folder / "preprocessor_config.json"
        nested = not path.exists()
        if nested:
            path = folder / "processor_config.json"
        if not path.exists():
            raise ModelError(f"{folder} has no preprocessor_config.json (the image processor's settings)")
        try:
            cfg = json.loads(path.read_text())
            return cls.from_dict(cfg["image_processor"] if nested else cfg)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ModelError(f"{path} has a bad value: {exc}") from None

    @classmethod
    def from_dict(cls, cfg: dict) -> "ClipImageProcessor":
        size, crop = cfg.get("size", {"shortest_edge": 224}), cfg.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if "shortest_edge" not in size:
            raise ModelError(f"image processor size {size} is not supported (a shortest_edge is needed)")
        return cls(shortest_edge=int(size["shortest_edge"]), crop_height=int(crop["height"]),
                   crop_width=int(crop["width"]), resample=_RESAMPLE[int(cfg.get("resample", 3))],
                   rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
                   mean=tuple(float(x) for x in cfg.get("image_mean", CLIP_MEAN)),
                   std=tuple(float(x) for x in cfg.get("image_std", CLIP_STD)),
                   do_resize=bool(cfg.get("do_resize", True)), do_center_crop=bool(cfg.get("do_center_crop", True)),
                   do_normalize=bool(cfg.get("do_normalize", True)), pad_to_square=bool(cfg.get("do_pad", False)))

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) of the pixel values for an image of this size."""
        if self.do_center_crop:
            return self.crop_height, self.crop_width
        if self.pad_to_square:
            width = height = max(width, height)
        if self.do_resize:
            height, width = self._resized(height, width)
        return height, width

    def _resized(self, height: int, width: int) -> tuple[int, int]:
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def __call__(self, image: Image.Image) -> np.ndarray:
        """[1, 3, H, W] float32 pixel values."""
        image = _to_rgb(image)
        if self.pad_to_square:
            image = _square(image, tuple(int(m * 255) for m in self.mean))
        if self.do_resize:
            height, width = self._resized(image.height, image.width)
            image = image.resize((width, height), resample=self.resample)
        array = np.asarray(image)
        if self.do_center_crop:
            array = _center_crop(array, self.crop_height, self.crop_width)
        pixels = array.transpose(2, 0, 1)[None]
        scaled = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if not self.do_normalize:
            return scaled
        mean = np.asarray(self.mean, dtype=np.float32)[None, :, None, None]
        std = np.asarray(self.std, dtype=np.float32)[None, :, None, None]
        return ((scaled - mean) / std).astype(np.float32)
