"""Read a Hugging Face model folder: config.json, *.safetensors, tokenizer.json."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from chatloom.models.config import ModelConfig, ModelError
from chatloom.models.hf_config import read_config_file
from chatloom.models.vision.idefics3 import VISION_ARCHITECTURES, Idefics3Config
from chatloom.models.vision.llava import LlavaConfig


def read_config(folder: Path) -> ModelConfig:
    """The decoder's config (a vision-language model's text_config)."""
    vision = read_vision_config(folder)
    if vision is not None:
        return vision.text
    path = folder / "config.json"
    if not path.exists():
        raise ModelError(f"{folder} has no config.json")
    cfg = read_config_file(path)
    cfg.name = folder.name
    return cfg


def read_vision_config(folder: Path) -> "Idefics3Config | LlavaConfig | None":
    """The whole config of a vision-language folder (Idefics3 / SmolVLM, LLaVA), or None for a text model."""
    path = folder / "config.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read config {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("model_type") not in VISION_ARCHITECTURES:
        return None
    if data["model_type"] == "llava":
        return LlavaConfig.from_hf(data, name=folder.name)
    return Idefics3Config.from_hf(data, name=folder.name)


def generation_eos(folder: Path) -> list[int]:
    """Stop tokens from generation_config.json / config.json (an int or a list)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        p = folder / name
        if p.exists():
            v = json.loads(p.read_text()).get("eos_token_id")
            ids += v if isinstance(v, list) else [v] if v is not None else []
    return sorted(set(ids))


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelError(f"cannot read {f}: {exc}") from None
    return {k: v.float() for k, v in out.items()}
