"""Read a Hugging Face model folder: config.json, *.safetensors, tokenizer.json."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from chatloom.models.config import ModelConfig, ModelError
from chatloom.models.hf_config import read_config_file


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.exists():
        raise ModelError(f"{folder} has no config.json")
    cfg = read_config_file(path)
    cfg.name = folder.name
    return cfg


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
