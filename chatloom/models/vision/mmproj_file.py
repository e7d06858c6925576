"""llama.cpp's projector file (`mmproj`: general.architecture "clip"), read with the `gguf` package:
its metadata, its tensors as float32, and the vision encoder's shape, for each family's loader
(LLaVA's in mmproj.py, Idefics3's in mmproj_idefics3.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatloom.models.config import ModelError
from chatloom.models.vision.siglip import SiglipConfig

_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16 (GGMLQuantizationType values)


class ProjectorFile:
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

    def need(self, key: str) -> Any:
        v = self.value(key)
        if v is None:
            raise ModelError(f"the projector file {self.path.name} lacks {key}")
        return v

    @property
    def kind(self) -> str | None:
        """clip.projector_type (mlp, idefics3, ...); files older than that key say has_llava_projector."""
        kind = self.value("clip.projector_type") or self.value("clip.vision.projector_type")
        if kind is None and self.value("clip.has_llava_projector", False):
            kind = "mlp"
        return kind

    def out_width(self, name: str) -> int | None:
        """The output width of matrix `name` (GGUF lists a tensor's sizes innermost first), None if absent."""
        t = self.tensors.get(name)
        return None if t is None else int(t.shape[-1])

    def tensor(self, name: str) -> torch.Tensor | None:
        t = self.tensors.get(name)
        if t is None:
            return None
        if int(t.tensor_type) in _FLOAT_TYPES:
            return torch.from_numpy(np.array(t.data, dtype=np.float32))
        from gguf.quants import dequantize

        return torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))


def encoder_config(p: ProjectorFile, hidden_act: str, layer_norm_eps: float) -> SiglipConfig:
    """The encoder's shape from clip.vision.*; `layer_norm_eps` where the file holds none."""
    def need(key: str) -> int:
        return int(p.need(f"clip.vision.{key}"))
    out = SiglipConfig(hidden_size=need("embedding_length"), intermediate_size=need("feed_forward_length"),
                       num_layers=need("block_count"), num_heads=need("attention.head_count"),
                       image_size=need("image_size"), patch_size=need("patch_size"),
                       layer_norm_eps=float(p.value("clip.vision.attention.layer_norm_epsilon", layer_norm_eps)),
                       hidden_act=hidden_act)
    if out.hidden_size % out.num_heads or out.image_size % out.patch_size:
        raise ModelError(f"the projector file {p.path.name}: the width must divide by the heads and the image "
                         "size by the patch size")
    return out
