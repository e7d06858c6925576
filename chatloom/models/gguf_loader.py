"""Read a GGUF file: architecture, weights (quantized blocks or dequantized), tokenizer and
chat template. Metadata keys follow llama.cpp's conventions (the gguf package's Keys), and
where llama.cpp derives a setting instead of storing it (Gemma's sliding-window pattern and
attention scale, the experts' weight normalisation) this derives it the same way."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, Keys

from chatloom.models import weight_repack
from chatloom.models.config import ModelConfig, ModelError, RopeScaling
from chatloom.models.gguf_names import hf_names
from chatloom.models.packed_linear import QUANTIZED_KINDS, QuantizedWeight

# GGUF general.architecture -> the family (Hugging Face model_type) it loads as. Mixtral files
# say "llama" and carry experts; llama.cpp's own "mistral" files are Llama too.
_FAMILIES = {
    MODEL_ARCH_NAMES[MODEL_ARCH.LLAMA]: "llama", "mistral": "mistral",
    MODEL_ARCH_NAMES[MODEL_ARCH.QWEN2]: "qwen2", MODEL_ARCH_NAMES[MODEL_ARCH.QWEN3]: "qwen3",
    MODEL_ARCH_NAMES[MODEL_ARCH.QWEN2MOE]: "qwen2_moe", MODEL_ARCH_NAMES[MODEL_ARCH.QWEN3MOE]: "qwen3_moe",
    MODEL_ARCH_NAMES[MODEL_ARCH.PHI3]: "phi3",
    MODEL_ARCH_NAMES[MODEL_ARCH.GEMMA2]: "gemma2", MODEL_ARCH_NAMES[MODEL_ARCH.GEMMA3]: "gemma3_text",
}
GGUF_ARCHITECTURES = tuple(_FAMILIES)


# GGUF metadata value types: scalar struct formats by type id (8 = string, 9 = array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
               10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (outermost first)
    data: np.ndarray  # raw, memory-mapped: elements for float types, bytes per row for quantized ones


class GGUFFile:
    """A GGUF file's metadata and tensor index, tensors memory-mapped.

    gguf.GGUFReader builds numpy views for every element of every metadata array,
    which takes seconds for a 49k-token vocabulary; this reads the same with struct.
    """

    def __init__(self, path: Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        self._mm = np.memmap(self.path, mode="r")
        buf = memoryview(self._mm)
        self._buf, self._size = buf, len(buf)
        if self._size < 24 or bytes(buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} (or a big-endian file)")
        offs = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, offs = self._string(offs)
            (vtype,) = struct.unpack_from("<I", buf, offs)
            self.metadata[key], offs = self._value(vtype, offs + 4)
        infos = []
        for _ in range(n_tensors):
            name, offs = self._string(offs)
            (n_dims,) = struct.unpack_from("<I", buf, offs)
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, offs + 4)
            raw_type, rel = struct.unpack_from("<IQ", buf, offs + 4 + 8 * n_dims)
            offs += 4 + 8 * n_dims + 12
            infos.append((name, dims, raw_type, rel))
        align = int(self.metadata.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"invalid alignment {align}")
        data_start = -(-offs // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, raw_type, rel in infos:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            shape = tuple(reversed(dims))
            if qtype.name in ("F32", "F16", "F64", "I8", "I16", "I32", "I64"):
                dtype = np.dtype({"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "i1", "I16": "<i2",
                                  "I32": "<i4", "I64": "<i8"}[qtype.name])
                count = n_elems
            else:
                if shape[-1] % block:
                    raise ValueError(f"tensor {name!r}: row size {shape[-1]} is not a multiple of {block}")
                dtype, count = np.dtype(np.uint8), n_elems // block * type_size
                shape = (*shape[:-1], shape[-1] // block * type_size)
            start = data_start + rel
            if start + count * dtype.itemsize > self._size:
                raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
            data = np.frombuffer(self._mm, dtype=dtype, count=count, offset=start).reshape(shape)
            self.tensors.append(GGUFTensor(name, qtype, shape, data))
        del self._buf, buf

    def _string(self, offs: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, offs)
        end = offs + 8 + n
        if end > self._size:
            raise ValueError("string runs past the end of the file (truncated?)")
        return str(self._buf[offs + 8:end], "utf-8"), end

    def _value(self, vtype: int, offs: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._string(offs)
        fmt = _SCALARS.get(vtype)
        if fmt is not None:
            return struct.unpack_from("<" + fmt, self._buf, offs)[0], offs + struct.calcsize(fmt)
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        itype, count = struct.unpack_from("<IQ", self._buf, offs)
        offs += 12
        if count > self._size - offs:  # every element takes at least one byte
            raise ValueError(f"array of {count} items is larger than the file")
        if itype in _NP_SCALARS:
            dt = np.dtype(_NP_SCALARS[itype])
            if offs + count * dt.itemsize > self._size:
                raise ValueError("array runs past the end of the file (truncated?)")
            arr = np.frombuffer(self._buf, dtype=dt, count=count, offset=offs)
            return arr.tolist(), offs + count * dt.itemsize
        if itype == _STRING:
            buf, out = self._buf, []
            unpack, size = struct.unpack_from, self._size
            for _ in range(count):
                (n,) = unpack("<Q", buf, offs)
                end = offs + 8 + n
                if end > size:
                    raise ValueError("string runs past the end of the file (truncated?)")
                out.append(str(buf[offs + 8:end], "utf-8"))
                offs = end
            return out, offs
        items = []
        for _ in range(count):
            v, offs = self._value(itype, offs)
            items.append(v)
        return items, offs


def open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except FileNotFoundError:
        raise ModelError(f"model file not found: {path}") from None
    except IsADirectoryError:
        raise ModelError(f"{path} is a directory, not a GGUF file") from None
    except Exception as exc:  # struct.error, ValueError, UnicodeDecodeError... on corrupt files
        raise ModelError(f"cannot read GGUF file {path}: {exc}") from None


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def _rope_scaling(reader: GGUFFile, arch: str, head_dim: int) -> RopeScaling:
    """RoPE scaling from the metadata; Llama 3.1+ files carry the llama3 frequency divisors
    as a rope_freqs tensor instead."""
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if freqs.tensor_type.name != "F32" or freqs.data.size != head_dim // 2:
            raise ModelError(f"rope_freqs must hold {head_dim // 2} float32 values")
        return RopeScaling(type="llama3", factor=1.0, freq_factors=[float(x) for x in freqs.data])
    kind = field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return RopeScaling()
    if kind not in ("linear", "yarn"):
        raise ModelError(f"RoPE scaling {kind!r} is not supported in GGUF files (linear, yarn, llama3)")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    return RopeScaling(type=kind, factor=float(factor or 0.0),
                       original_max_position=int(original) if original else None,
                       beta_fast=float(field(reader, f"{arch}.rope.scaling.yarn_beta_fast") or 32.0),
                       beta_slow=float(field(reader, f"{arch}.rope.scaling.yarn_beta_slow") or 1.0))


def _key(key: str, arch: str) -> str:
    return key.format(arch=arch)


def _layer_windows(reader: GGUFFile, arch: str, family: str, layers: int) -> list[int | None] | None:
    """Each layer's attention window. llama.cpp stores one window size and derives which
    layers slide (Gemma 2: every other one, from the first; Gemma 3: five of every six),
    unless the file states a pattern. Only the families whose Hugging Face layers slide read it."""
    window = field(reader, _key(Keys.Attention.SLIDING_WINDOW, arch))
    if not window or family not in ("gemma2", "gemma3_text", "phi3"):
        return None
    pattern = field(reader, _key(Keys.Attention.SLIDING_WINDOW_PATTERN, arch))
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelError(f"GGUF sliding-window pattern has {len(pattern)} entries for {layers} layers")
        sliding = [bool(x) for x in pattern]
    else:
        # llama.cpp's set_swa_pattern(n): layer i slides when i % n < n - 1 (0: every layer).
        n = int(pattern) if pattern is not None else {"gemma2": 2, "gemma3_text": 6}.get(family, 0)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    return [int(window) if s else None for s in sliding] if any(sliding) else None


def _gemma(reader: GGUFFile, arch: str, family: str, hidden: int, heads: int, head_dim: int,
           layers: int) -> dict[str, Any]:
    """Gemma 2/3 settings: the norms (stored as 1 + w already: llama.cpp's converter adds the
    1), GELU, embedding scale, soft-caps and the attention scale, which GGUF files do not
    store: llama.cpp uses 1/sqrt(hidden / heads) for the 27B models (their query_pre_attn_scalar)
    and 1/sqrt(head_dim) for the others, recognising the 27B by its layer count."""
    explicit = field(reader, _key(Keys.Attention.SCALE, arch))
    big = layers == (46 if family == "gemma2" else 62)
    scale = float(explicit) if explicit else (hidden // heads if big else head_dim) ** -0.5
    attn_cap = field(reader, _key(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, arch))
    final_cap = field(reader, _key(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, arch))
    return dict(sandwich_norms=True, hidden_act="gelu_tanh", embedding_scale=hidden ** 0.5,
                attention_scale=scale, attn_softcap=float(attn_cap) if attn_cap else None,
                final_softcap=float(final_cap) if final_cap else None)


def _experts(reader: GGUFFile, arch: str, family: str, layers: int, ffn: int) -> dict[str, Any]:
    """Mixture-of-experts settings. Which layers are MoE comes from the tensors present
    (a router per MoE layer); the routing weights are renormalised as llama.cpp does per
    family (Mixtral and Qwen3-MoE yes, Qwen2-MoE no) unless the file says."""
    count = int(field(reader, _key(Keys.LLM.EXPERT_COUNT, arch)) or 0)
    if not count:
        return {}
    gating = field(reader, _key(Keys.LLM.EXPERT_GATING_FUNC, arch))
    if gating not in (None, 1):  # gguf.ExpertGatingFuncType.SOFTMAX
        raise ModelError(f"expert gating function {gating} is not supported (softmax only)")
    names = {t.name: t for t in reader.tensors}
    norm = field(reader, _key(Keys.LLM.EXPERT_WEIGHTS_NORM, arch))
    shared = field(reader, _key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, arch))
    shexp = next((t for n, t in names.items() if n.endswith(".ffn_gate_shexp.weight")), None)
    if not shared and shexp is not None:
        shared = shexp.shape[0]
    return dict(
        num_experts=count,
        num_experts_per_tok=int(field(reader, _key(Keys.LLM.EXPERT_USED_COUNT, arch)) or 0),
        moe_intermediate_size=int(field(reader, _key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, arch)) or ffn),
        norm_topk_prob=bool(norm) if norm is not None else family != "qwen2_moe",
        shared_expert_intermediate_size=int(shared or 0) if shexp is not None else 0,
        moe_layers=[f"blk.{i}.ffn_gate_inp.weight" in names for i in range(layers)],
    )


def read_config(reader: GGUFFile, name: str) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelError(f"unsupported architecture {arch!r} in a GGUF file (supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}; other families load from Hugging Face folders)")
    family = _FAMILIES[arch]

    def need(key: str) -> Any:
        v = field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelError(f"GGUF metadata lacks {arch}.{key}")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    layers = int(need("block_count"))
    ffn = int(need("feed_forward_length"))
    head_dim = int(field(reader, f"{arch}.attention.key_length") or hidden // max(heads, 1))
    names = {t.name for t in reader.tensors}
    rot = field(reader, f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ModelError(f"partial rotary embeddings ({rot} of {head_dim} dims) are not supported")
    if "rope_factors_long.weight" in names:
        raise ModelError("RoPE scaling 'longrope' (Phi-3 128k) is not supported")
    scaling = _rope_scaling(reader, arch, head_dim)
    # The embedding's rows are the model's vocabulary (it may be padded past the tokenizer's).
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = (embd.shape[0] if embd is not None and len(embd.shape) == 2 else None) \
        or field(reader, f"{arch}.vocab_size") or len(field(reader, "tokenizer.ggml.tokens", []))
    trained = int(need("context_length"))
    extra: dict[str, Any] = {}
    windows = _layer_windows(reader, arch, family, layers)
    if family in ("gemma2", "gemma3_text"):
        extra.update(_gemma(reader, arch, family, hidden, heads, head_dim, layers))
        if family == "gemma3_text" and windows:  # llama.cpp's base for Gemma 3's sliding layers
            extra["rope_local_theta"] = float(field(reader, _key(Keys.Rope.FREQ_BASE_SWA, arch)) or 10000.0)
    moe = _experts(reader, arch, family, layers, ffn)
    if moe and family in ("llama", "mistral"):
        family = "mixtral"
    return ModelConfig(
        architecture=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        max_position=scaling.context_length(trained),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=scaling,
        rope_trained_max_position=trained,
        # llama.cpp's converter permutes Q/K of llama/mistral models (Mixtral included) for its
        # interleaved RoPE; the other families keep the half-rotation ("neox") layout.
        rope_interleaved=arch in ("llama", "mistral"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        layer_windows=windows,
        name=name,
        **extra,
        **moe,
    )


def _hf_weights(reader: GGUFFile, family: str) -> dict[str, tuple[GGUFTensor, int | None]]:
    """Each Hugging Face weight the file holds: its tensor, and the expert's index in a stacked one."""
    out = {}
    for t in reader.tensors:
        for name, index in hf_names(family, t.name, t.shape):
            out[name] = (t, index)
    return out


def read_quantized(reader: GGUFFile, family: str) -> dict[str, QuantizedWeight]:
    """The weights stored in a block format our matmul kernels read as is (Q4_0, Q4_1,
    Q8_0, Q4_K, Q5_K, Q6_K), raw, keyed by their Hugging Face name; each expert of a
    stacked 3-D tensor is its own weight, a view of its rows."""
    from gguf.constants import GGML_QUANT_SIZES

    out = {}
    for name, (t, index) in _hf_weights(reader, family).items():
        if t.tensor_type.name not in QUANTIZED_KINDS or len(t.shape) != (2 if index is None else 3):
            continue
        data = t.data if index is None else t.data[index]
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        rows, nbytes = data.shape
        out[name] = QuantizedWeight(t.tensor_type.name, data, rows, nbytes // type_size * block)
    return out


class GGUFWeights:
    """Tensors of a GGUF file by Hugging Face name, dequantized to float32 only when asked
    for: layers that keep their quantized blocks never exist in float32 at all."""

    def __init__(self, reader: GGUFFile, family: str) -> None:
        self._tensors = _hf_weights(reader, family)

    def get(self, name: str) -> torch.Tensor | None:
        from gguf import quants

        found = self._tensors.get(name)
        if found is None:
            return None
        t, index = found
        data = t.data if index is None else t.data[index]
        try:
            native = weight_repack.dequantize(data, t.tensor_type.name, (*data.shape[:-1], -1))
            if native is not None:
                gate = native.dim() == 1 and name.endswith("shared_expert_gate.weight")
                return native.reshape(1, -1) if gate else native
            arr = quants.dequantize(data, t.tensor_type)
        except Exception as exc:
            raise ModelError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {exc}") from None
        if arr.ndim == 1 and name.endswith("shared_expert_gate.weight"):
            arr = arr.reshape(1, -1)  # llama.cpp keeps Qwen2-MoE's [1, hidden] gate as a vector
        return torch.from_numpy(np.require(arr, dtype=np.float32, requirements=["C", "W"]))

    def kinds(self) -> dict[str, str]:
        """Each weight's storage type, by Hugging Face name."""
        return {name: t.tensor_type.name for name, (t, _) in self._tensors.items()}


def read_weights(reader: GGUFFile, family: str) -> GGUFWeights:
    """Every weight of a `family` model (its ModelConfig.architecture), dequantized to
    float32 on demand, keyed by its Hugging Face name."""
    return GGUFWeights(reader, family)
