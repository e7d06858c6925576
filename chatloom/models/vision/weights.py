"""Filling a vision module's weights from a file by name, each checked for presence and shape."""
from __future__ import annotations

from typing import Callable

import torch

from chatloom.models.config import ModelError


def load_named(module: torch.nn.Module, names: dict[str, str], get: Callable[[str], torch.Tensor | None],
               dtype: torch.dtype, convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Fill `module`'s weights: `names` maps ours to the file's, `convert` reshapes a file's tensor. A
    missing or misshapen weight is a ModelError naming it."""
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    state = {}
    for ours, theirs in names.items():
        tensor = get(theirs)
        if tensor is None:
            raise ModelError(f"weight {theirs!r} is missing from the model file")
        if convert is not None:
            tensor = convert(ours, tensor)
        if tuple(tensor.shape) != shapes[ours]:
            raise ModelError(f"weight {theirs} has shape {tuple(tensor.shape)}, expected {shapes[ours]} "
                             "(the weights do not match the model's config)")
        state[ours] = tensor.to(dtype)
    module.load_state_dict(state, strict=True)
