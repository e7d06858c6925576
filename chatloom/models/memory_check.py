"""Will a model fit? Weights plus the KV cache asked for, against the memory available.

Checked before any weight is read, so a model too big for the machine is refused with one
line naming the sizes instead of being killed by the kernel's out-of-memory handler half-way
through loading. The weight estimate follows what the loader keeps: GGUF blocks that a
kernel reads stay at their panel layout's size (see packed_linear.quantized_layout, and
kquant_panels.py for Q4_K and Q6_K in the exact mode on AVX-512), every other tensor becomes
float32 (or the chosen dtype).
"""
from __future__ import annotations

from pathlib import Path

from chatloom.models.config import ModelConfig, ModelError

# Bytes per weight once packed for the kernels: codes plus a float32 (d, m) per 32 or per 16.
_KEPT_BYTES_PER_WEIGHT = {"Q4_1": 0.75, "Q4_K": 0.75, "Q4_0": 1.25, "Q8_0": 1.25, "Q5_K": 1.25, "Q6_K": 1.5}
# With int8 activations an 8-bit-code layer whose groups have an offset (Q5_K) keeps the offsets again
# as a float32 panel of their own, multiplied by the block sums of x (the nibble layouts' kernel applies
# their offsets itself), and Q4_0 is kept as Q4_1's nibbles (packed_linear.q4_0_as_q4_1).
_OFFSET_KINDS = {"Q5_K"}
_INT8_OFFSET_BYTES_PER_WEIGHT = 4 / 32
# Q4_K and Q6_K kept in their super-blocks (kquant_panels.py): 4.625 and 6.5625 bits, each part its own.
_SUPER_BLOCK_BYTES_PER_WEIGHT = {"Q4_K": 4.625 / 8, "Q6_K": 6.5625 / 8}
_FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
# Embeddings looked up from their blocks (quantized_embedding.py; weight_repack.NATIVE_DEQUANT): bytes a weight.
EMBEDDING_BLOCK_BYTES_PER_WEIGHT = {"Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q8_0": 34 / 32, "Q4_K": 144 / 256,
                                    "Q5_K": 176 / 256, "Q6_K": 210 / 256}


def available_memory_bytes() -> int | None:
    """Memory this process can still take: MemAvailable, or less under a cgroup limit
    (containers); None where neither can be read."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


# GGUF tensors the loader fuses into one matmul (QKV, gate + up): a fused layer keeps its
# blocks only when every part can, and in the grouped layout (1.5 B/weight) when its parts'
# types differ, as packed_linear.quantized_layout decides.
_FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up",
          "ffn_gate_exps": "gate_up_exps", "ffn_up_exps": "gate_up_exps",
          "ffn_gate_shexp": "gate_up_shexp", "ffn_up_shexp": "gate_up_shexp"}


def _fused_key(name: str) -> tuple[str, str] | None:
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _FUSED and parts[3] == "weight":
        return parts[1], _FUSED[parts[2]]
    return None


def gguf_weight_bytes(tensors, float_bytes: int, keeps_quantized: bool, super_blocks: bool = False,
                      float_embedding: bool = False, int8_activations: bool = False) -> int:
    """Resident bytes of a GGUF file's tensors (gguf_loader.GGUFTensor list) once loaded;
    `super_blocks`: Q4_K and Q6_K layers are kept in their super-blocks (loader.gguf_layout says when);
    a quantized embedding is looked up from its blocks where the matmuls keep blocks too, unless
    `float_embedding` (the bfloat16 mode, whose tied head is made from the float32 table);
    `int8_activations`: 8-bit-code layers with an offset keep it apart as well, and Q4_0 layers take
    Q4_1's nibbles (QuantizedLinear)."""

    def grouped(kinds: set[str], kind: str, n: int) -> int:
        if len(kinds) > 1:
            return int(n * _KEPT_BYTES_PER_WEIGHT["Q6_K"])
        if int8_activations and kind == "Q4_0":
            return int(n * _KEPT_BYTES_PER_WEIGHT["Q4_1"])
        extra = n * _INT8_OFFSET_BYTES_PER_WEIGHT if int8_activations and kind in _OFFSET_KINDS else 0
        return int(n * _KEPT_BYTES_PER_WEIGHT[kind] + extra)

    fused: dict[tuple[str, str], set[str]] = {}
    for t in tensors:
        key = _fused_key(t.name)
        if key is not None:
            fused.setdefault(key, set()).add(t.tensor_type.name)
    total = 0
    for t in tensors:
        kind = t.tensor_type.name
        n = _numel(t)
        kinds = fused.get(_fused_key(t.name), {kind})
        super_block = super_blocks and kinds <= _SUPER_BLOCK_BYTES_PER_WEIGHT.keys() and len(t.shape) in (2, 3)
        if t.name == "token_embd.weight":
            if keeps_quantized and not float_embedding and kind in EMBEDDING_BLOCK_BYTES_PER_WEIGHT:
                total += int(n * EMBEDDING_BLOCK_BYTES_PER_WEIGHT[kind])
            else:
                total += n * float_bytes  # the embedding table is looked up in floats
            if kind in _KEPT_BYTES_PER_WEIGHT and keeps_quantized and not any(
                    u.name == "output.weight" for u in tensors):  # and packed again as the tied head
                total += int(n * _SUPER_BLOCK_BYTES_PER_WEIGHT[kind]) if super_block else grouped({kind}, kind, n)
        elif keeps_quantized and super_block:
            total += int(n * _SUPER_BLOCK_BYTES_PER_WEIGHT[kind])
        elif (keeps_quantized and kinds <= _KEPT_BYTES_PER_WEIGHT.keys()
              and len(t.shape) in (2, 3)):  # 3: stacked experts
            total += grouped(kinds, kind, n)
        else:
            total += n * float_bytes
    return total


def _numel(t) -> int:
    """Elements of a GGUF tensor (its data is raw bytes per row for quantized types)."""
    from gguf.constants import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    count = 1
    for d in t.shape[:-1]:
        count *= d
    last = t.shape[-1] if t.tensor_type.name in _FLOAT_BYTES or t.tensor_type.name.startswith("I") \
        else t.shape[-1] // type_size * block
    return count * last


def dense_weight_bytes(cfg: ModelConfig, float_bytes: int) -> int:
    return cfg.num_parameters() * float_bytes


def vision_weight_bytes(cfg, float_bytes: int) -> int:
    """The image side of a vision-language model (an Idefics3Config): encoder and connector."""
    return cfg.vision_parameters() * float_bytes


def format_bytes(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def check_fits(what: str, weight_bytes: int, kv_bytes: int, available: int | None = None) -> None:
    """Raise ModelError (one line, the sizes named) when weights + KV cache exceed memory.
    CHATLOOM_RUNTIME__SKIP_MEMORY_CHECK=1 turns the check off (swap, or memory freed later)."""
    from chatloom.settings import environment_settings

    if environment_settings().runtime.skip_memory_check:
        return
    available = available_memory_bytes() if available is None else available
    if available is None or weight_bytes + kv_bytes <= available:
        return
    if weight_bytes:
        sizes = (f"weights {format_bytes(weight_bytes)} + KV cache {format_bytes(kv_bytes)} = "
                 f"{format_bytes(weight_bytes + kv_bytes)}")
    else:
        sizes = f"it needs {format_bytes(kv_bytes)}"
    raise ModelError(f"{what} does not fit in memory: {sizes}, but only {format_bytes(available)} is "
                     "available (use a smaller quantization or a smaller KV cache)")
