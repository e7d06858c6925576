"""The token embedding kept in the file's blocks: rows are expanded to float32 when looked up.

A GGUF file stores the embedding quantized (a Q4_K_M file in Q6_K: 0.82 bytes a weight); kept in
float32 it is the largest tensor a small model holds (49,152 x 2,048 x 4 bytes = 403 MB for
SmolLM2-1.7B, against 82 MB of blocks). A lookup expands only the rows it needs, to the values of
gguf's dequantizer, so every output is the float32 table's bit for bit.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from chatloom.models.kernels import load_kernels
from chatloom.models.weight_repack import NATIVE_DEQUANT, as_bytes, mapped_alone


def can_keep(kind: str) -> bool:
    """Whether an embedding stored as `kind` can be looked up from its blocks here."""
    kernels = load_kernels()
    return kind in NATIVE_DEQUANT and kernels is not None and hasattr(kernels, "dequantize_blocks")


class QuantizedEmbedding(nn.Module):
    """nn.Embedding's lookups from GGUF blocks [vocab, bytes a row]: a read-only mapping of the table's
    own bytes in the file where `raw` is a view of a mapped file (no copy, and not the rest of the file),
    a copy otherwise."""

    def __init__(self, raw: np.ndarray, kind: str, hidden: int) -> None:
        super().__init__()
        if not can_keep(kind):
            raise ValueError(f"no lookup from {kind} blocks here")
        self.kind, self.hidden = kind, hidden
        mapped = mapped_alone(raw)
        blocks = as_bytes(mapped) if mapped is not None else torch.from_numpy(np.array(raw, dtype=np.uint8, order="C"))
        self.register_buffer("blocks", blocks, persistent=False)
        self.num_embeddings = self.blocks.shape[0]
        self.embedding_dim = hidden

    @property
    def weight(self) -> torch.Tensor:
        """A float32 tensor with no rows: what callers read of an embedding's weight is its dtype,
        the lookups' (the table itself is `blocks`)."""
        return torch.empty(0, self.hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids.reshape(-1))  # IndexError outside the vocabulary
        out = load_kernels().dequantize_blocks(rows, self.kind)
        return out.reshape(*input_ids.shape, self.hidden)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.hidden}, kind={self.kind}"
