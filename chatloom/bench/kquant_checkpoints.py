"""A Q4_K_M file of a real shape with random block bytes, written in seconds, for speed measurements.

`llama-quantize` makes the real thing from the F16 file (docs/speed.md), but drawing the F16 weights
and quantizing them takes most of an hour at the 3B shape on two cores. A decode step's cost does not
depend on the values: only on the tensors' types and sizes. So this writes each matrix in the type
llama.cpp's Q4_K_M gives it (Q6_K for the tied embedding and for the V and down projections of the
layers `_more_bits` names, Q4_K for the rest), as random bytes with every super-block's scales set
small, so that activations stay finite through the layers; norms stay float32. The file has the size
of llama-quantize's to within its metadata (1,055,609,216 bytes against 1,055,609,280 at the 1.7B
shape), and its outputs are meaningless.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from chatloom.bench import checkpoints
from chatloom.bench.checkpoints import Shape

SUPER_BLOCK = 256
SCALE = np.float16(3e-6)  # each super-block's d (and Q4_K's dmin): small enough for 28 layers


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose V and down projections Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int):
    """The GGML type a Q4_K_M file gives the matrix `name` (a GGUF tensor name)."""
    from gguf import GGMLQuantizationType as Q

    if name.startswith(("token_embd.", "output.")):
        return Q.Q6_K
    if ".attn_v." in name or ".ffn_down." in name:
        return Q.Q6_K if _more_bits(int(name.split(".")[1]), layers) else Q.Q4_K
    return Q.Q4_K


def random_blocks(kind: Any, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] of random super-blocks of `kind` (Q4_K or Q6_K) with small scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    size = GGML_QUANT_SIZES[kind][1]
    blocks = rng.integers(0, 256, size=(rows, cols // SUPER_BLOCK, size), dtype=np.uint8)
    scale = np.frombuffer(SCALE.tobytes(), dtype=np.uint8)
    if kind == Q.Q4_K:  # d, dmin, then the sub-blocks' scales and the codes
        blocks[:, :, 0:2] = scale
        blocks[:, :, 2:4] = scale
    else:  # Q6_K: low and high code bits, the sub-blocks' scales, then d
        blocks[:, :, size - 2:size] = scale
    return blocks.reshape(rows, -1)


def write_random_q4_k_m(shape: Shape, path: Path, seed: int = 0) -> int:
    """Write the file at `path`; its size in bytes."""
    import gguf

    layers = shape.config["num_hidden_layers"]
    rng = np.random.default_rng(seed)

    def tensors(shape_: Shape, seed_: int):
        for name, dims, dtype, make in checkpoints._gguf_tensors(shape_, seed_):
            if len(dims) == 2:
                dtype = q4_k_m_type(name, layers)
                make = (lambda k=dtype, d=dims: random_blocks(k, d[0], d[1], rng))
            yield name, dims, dtype, make

    checkpoints.write_gguf(shape, Path(path), seed, checkpoints.tokenizer_metadata(shape), tensors=tensors,
                           file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M)
    return Path(path).stat().st_size
