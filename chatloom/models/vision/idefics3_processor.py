"""Idefics3 / SmolVLM image preprocessing, the same pixel values as transformers' processor.

An image is converted to RGB (transparency over white), resized so its longest edge is `size`
(Lanczos), then, with splitting on, resized up to whole multiples of the encoder's tile and cut into
rows x cols tiles plus one global view resized to a single tile; every tile is rescaled to [0, 1]
and normalized. The prompt gives each tile its own run of image tokens (`prompt_text`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from chatloom.models.config import ModelError

_MAX_IMAGE_SIZE = 4096  # transformers' absolute cap on the resized longest edge
_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
             3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


@dataclass
class PreparedImage:
    """An image resized for its tiles (uint8 RGB, far smaller than their float pixels), and its grid."""

    image: Image.Image
    rows: int  # 0 and 0 when the image is one tile
    cols: int

    @property
    def num_tiles(self) -> int:
        return self.rows * self.cols + 1


@dataclass
class ProcessedImage:
    pixel_values: np.ndarray  # [tiles, 3, tile, tile] float32, the global view last
    rows: int  # 0 and 0 when the image is not split
    cols: int


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def _to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass
class Idefics3ImageProcessor:
    tile: int = 364  # max_image_size.longest_edge: the encoder's input side
    longest_edge: int = 4 * 364  # size.longest_edge
    split: bool = True
    resample: Image.Resampling = Image.Resampling.LANCZOS
    rescale_factor: float = 1 / 255
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_resize: bool = True

    @classmethod
    def from_folder(cls, folder: Path) -> "Idefics3ImageProcessor":
        # The hub's folders have preprocessor_config.json; transformers 5 nests it in processor_config.json.
        path = folder / "preprocessor_config.json"
        nested = not path.exists()
        if nested:
            path = folder / "processor_config.json"
        if not path.exists():
            raise ModelError(f"{folder} has no preprocessor_config.json (the image processor's settings)")
        try:
            cfg = json.loads(path.read_text())
            if nested:
                cfg = cfg["image_processor"]
            return cls(tile=int(cfg.get("max_image_size", {}).get("longest_edge", 364)),
                       longest_edge=int(cfg.get("size", {}).get("longest_edge", 4 * 364)),
                       split=bool(cfg.get("do_image_splitting", True)),
                       resample=_RESAMPLE[int(cfg.get("resample", 1))],
                       rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
                       mean=tuple(float(x) for x in cfg.get("image_mean", (0.5, 0.5, 0.5))),
                       std=tuple(float(x) for x in cfg.get("image_std", (0.5, 0.5, 0.5))),
                       do_resize=bool(cfg.get("do_resize", True)))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ModelError(f"{path} has a bad value: {exc}") from None

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        return image.resize((width, height), resample=self.resample)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of tiles for an image of this size (0, 0: one global view only), without
        touching a pixel: what the prompt and the token count need."""
        if self.do_resize:
            height, width = _scale_below(*_rescale_to_max_len(height, width, self.longest_edge), _MAX_IMAGE_SIZE)
        if not self.split:
            return 0, 0
        height, width = self._vision_size(height, width)
        if height > self.tile or width > self.tile:
            return height // self.tile, width // self.tile
        return 0, 0

    def _vision_size(self, height: int, width: int) -> tuple[int, int]:
        """Sides rounded up to whole tiles, keeping the aspect ratio as transformers does."""
        tile, aspect = self.tile, width / height
        if width >= height:
            width = math.ceil(width / tile) * tile
            height = math.ceil(int(width / aspect) / tile) * tile
        else:
            height = math.ceil(height / tile) * tile
            width = math.ceil(int(height * aspect) / tile) * tile
        return height, width

    def prepare(self, image: Image.Image) -> PreparedImage:
        """The image resized as the tiles are cut from it, before any tile is: what `tile_pixels` reads."""
        image = _to_rgb(image)
        if self.do_resize:
            h, w = _scale_below(*_rescale_to_max_len(image.height, image.width, self.longest_edge), _MAX_IMAGE_SIZE)
            image = self._resize(image, h, w)
        if not self.split:
            return PreparedImage(self._resize(image, self.tile, self.tile), 0, 0)
        image = self._resize(image, *self._vision_size(image.height, image.width))
        if image.height > self.tile or image.width > self.tile:
            return PreparedImage(image, image.height // self.tile, image.width // self.tile)
        return PreparedImage(image, 0, 0)

    def tile_pixels(self, prepared: PreparedImage, index: int) -> np.ndarray:
        """Tile `index` [3, tile, tile] of a prepared image, normalized: the rows x cols crops by rows,
        then the global view (one tile only when the image is not split)."""
        rows, cols, t = prepared.rows, prepared.cols, self.tile
        if index < rows * cols:
            r, c = divmod(index, cols)
            pixels = np.asarray(prepared.image.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)))
        elif index == rows * cols:
            whole = prepared.image
            pixels = np.asarray(whole if rows == 0 else self._resize(whole, t, t))
        else:
            raise IndexError(f"tile {index} of an image of {rows * cols + 1} tiles")
        scaled = (pixels.transpose(2, 0, 1).astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.std, dtype=np.float32)[:, None, None]
        return ((scaled - mean) / std).astype(np.float32)

    def __call__(self, image: Image.Image) -> ProcessedImage:
        prepared = self.prepare(image)
        tiles = [self.tile_pixels(prepared, i) for i in range(prepared.num_tiles)]
        return ProcessedImage(np.stack(tiles), prepared.rows, prepared.cols)


def prompt_text(rows: int, cols: int, seq_len: int, image_token: str = "<image>",
                around: str = "<fake_token_around_image>", global_tag: str = "<global-img>") -> str:
    """What one image becomes in the prompt text: each tile's tag and image tokens by rows, then the
    global view's (transformers' Idefics3Processor writes the same string)."""
    run = image_token * seq_len
    if rows == 0 and cols == 0:
        return f"{around}{global_tag}{run}{around}"
    text = "".join("".join(f"{around}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return text + f"\n{around}{global_tag}{run}{around}"
