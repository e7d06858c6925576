"""Random-weight checkpoints of real model shapes, made offline, for benchmarks at realistic sizes.

A benchmark on the bundled 135M model says little about the 1-3B models people serve. These
checkpoints have the published shapes of SmolLM2-1.7B, Qwen2.5-1.5B and Llama-3.2-3B (their
config.json as published: tied embeddings, grouped-query attention, Qwen's QKV biases, Llama 3's
RoPE scaling) and seeded random weights, so every byte read and every multiply costs what it costs
with the real model while the text they write is meaningless. No hub access: the shapes are
written down here, and the tokenizer is the bundled SmolLM2 GGUF's where the vocabulary is the
same (SmolLM2), else a byte-level one padded to the model's vocabulary with the family's special
tokens at their published ids.

Each checkpoint is written twice, with the same weight values:
  - a Hugging Face folder (config.json, sharded bfloat16 safetensors, tokenizer.json,
    tokenizer_config.json, generation_config.json), for chatloom and vLLM;
  - a GGUF F16 file laid out as llama.cpp's converter lays it out (Q/K rows permuted for the
    llama family's interleaved RoPE, 1-D tensors in float32, Llama 3's rope_freqs), for chatloom,
    llama-server and llama-quantize.
Weights are drawn in bfloat16 with magnitudes below float16's normal range flushed to zero, so each
value is exact in both files and both load to the same float32 model.
"""
from __future__ import annotations

import copy
import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import numpy as np
import torch

# Hugging Face's initializer_range in every one of these configs: the scale of a trained model's weights.
WEIGHT_STD = 0.02
_F16_TINY = 2.0 ** -14  # float16's smallest normal number
_SHARD_BYTES = 2 << 30


@dataclass(frozen=True)
class Shape:
    """A model shape: its config.json as published, and how to make its tokenizer."""

    name: str
    config: dict[str, Any]
    # "smollm2": the bundled SmolLM2 GGUF's tokenizer (its vocabulary must match); "byte": byte-level.
    tokenizer: str = "byte"
    # Byte-level only: special tokens at their published ids, which of them ends a turn, and
    # whether a prompt starts with the BOS token.
    specials: dict[int, str] = field(default_factory=dict)
    eos: str = ""
    bos: str = ""
    chat_template: str = ""

    @property
    def family(self) -> str:
        return self.config["model_type"]


_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
           " + m['content'] + '<|eot_id|>' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

SHAPES: dict[str, Shape] = {
    "smollm2-1.7b": Shape("smollm2-1.7b", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 130000, "rope_scaling": None, "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": True, "vocab_size": 49152, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 2, "initializer_range": 0.02, "torch_dtype": "bfloat16"},
        tokenizer="smollm2"),
    "qwen2.5-1.5b": Shape("qwen2.5-1.5b", {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
        "max_window_layers": 21, "tie_word_embeddings": True, "vocab_size": 151936,
        "bos_token_id": 151643, "eos_token_id": 151645, "initializer_range": 0.02, "torch_dtype": "bfloat16"},
        specials={151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"},
        eos="<|im_end|>", chat_template=_CHATML),
    "llama3.2-3b": Shape("llama3.2-3b", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "head_dim": 128,
        "num_attention_heads": 24, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True, "vocab_size": 128256,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "initializer_range": 0.02,
        "torch_dtype": "bfloat16"},
        specials={128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128006: "<|start_header_id|>",
                  128007: "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>"},
        eos="<|eot_id|>", bos="<|begin_of_text|>", chat_template=_LLAMA3),
}


class CheckpointError(ValueError):
    """A shape or an output path that cannot be written; the message names the problem."""


def shrink(shape: Shape, **sizes: int) -> Shape:
    """The same family and features at other sizes (hidden_size, num_hidden_layers, ... as in
    config.json): small checkpoints for tests. A byte-level vocabulary keeps its specials below it."""
    cfg = copy.deepcopy(shape.config)
    cfg.update(sizes)
    specials = dict(shape.specials)
    if shape.specials and "vocab_size" in sizes:
        # Move the specials to the top of the smaller vocabulary, in their order.
        top = sizes["vocab_size"] - len(specials)
        moved = {old: top + i for i, old in enumerate(sorted(specials))}
        specials = {moved[i]: t for i, t in specials.items()}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = cfg.get(key)
            if isinstance(v, list):
                cfg[key] = [moved[x] for x in v if x in moved]
            elif v is not None:
                cfg[key] = moved.get(v, v)
    return Shape(f"{shape.name}-small", cfg, shape.tokenizer, specials, shape.eos, shape.bos, shape.chat_template)


# -- dimensions ---------------------------------------------------------------------------------------

def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int, int]:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    return hidden, cfg["intermediate_size"], heads, kv, head_dim, cfg["vocab_size"]


def hf_tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Every weight of the Hugging Face checkpoint and its shape, in a stable order."""
    cfg = shape.config
    hidden, inter, heads, kv, d, vocab = _dims(cfg)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    bias = shape.family == "qwen2" or bool(cfg.get("attention_bias"))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (hidden,)
        for name, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            out[p + f"self_attn.{name}_proj.weight"] = (rows, hidden)
            if bias:
                out[p + f"self_attn.{name}_proj.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (hidden, heads * d)
        out[p + "post_attention_layernorm.weight"] = (hidden,)
        out[p + "mlp.gate_proj.weight"] = (inter, hidden)
        out[p + "mlp.up_proj.weight"] = (inter, hidden)
        out[p + "mlp.down_proj.weight"] = (hidden, inter)
    out["model.norm.weight"] = (hidden,)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (vocab, hidden)
    return out


def weight(name: str, dims: tuple[int, ...], seed: int) -> torch.Tensor:
    """One weight's values in bfloat16, the same for a name and seed whatever else is written:
    norms are 1, everything else N(0, WEIGHT_STD) with values too small for float16 set to 0."""
    if name.endswith("norm.weight"):
        return torch.ones(dims, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    w = torch.randn(dims, generator=gen, dtype=torch.float32).mul_(WEIGHT_STD).to(torch.bfloat16)
    return w.masked_fill_(w.abs() < _F16_TINY, 0.0)


# -- the tokenizer --------------------------------------------------------------------------------------

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _CONTROL = 1, 3
# A few merges: GGUF BPE tokenizers must carry some, and common pairs make English text shorter.
_MERGES = ["Ġ t", "h e", "Ġ a", "i n", "e r", "o n", "r e", "Ġt he", "e n", "a t"]


def _byte_level_metadata(shape: Shape) -> dict[str, Any]:
    """tokenizer.* metadata of a byte-level BPE vocabulary the model's size: the 256 byte symbols, a
    few merges, the shape's special tokens at their ids, filler tokens `<|unused_N|>` everywhere else."""
    from tokenizers import pre_tokenizers

    vocab = shape.config["vocab_size"]
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += ["".join(m.split(" ")) for m in _MERGES]
    types = [_NORMAL] * len(tokens)
    if len(tokens) + len(shape.specials) > vocab or any(i < len(tokens) or i >= vocab for i in shape.specials):
        raise CheckpointError(f"{shape.name}: a byte-level vocabulary needs {len(tokens)} ids below the "
                              f"special tokens, within vocab_size {vocab}")
    while len(tokens) < vocab:
        i = len(tokens)
        tokens.append(shape.specials.get(i, f"<|unused_{i}|>"))
        # Filler ids are ordinary tokens with visible text: a random-weight model draws them almost
        # always, and a server streams nothing for a token without text (llama-server sends no chunk),
        # which would leave a benchmark with no tokens to time.
        types.append(_CONTROL if i in shape.specials else _NORMAL)
    ids = {t: i for i, t in shape.specials.items()}
    if shape.eos not in ids:
        raise CheckpointError(f"{shape.name}: its end-of-turn token {shape.eos!r} is not among its specials")
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": list(_MERGES),
        "tokenizer.ggml.eos_token_id": ids[shape.eos], "tokenizer.ggml.add_bos_token": bool(shape.bos),
        "tokenizer.chat_template": shape.chat_template,
    }
    if shape.bos:
        meta["tokenizer.ggml.bos_token_id"] = ids[shape.bos]
    return meta


def _smollm2_metadata(shape: Shape) -> dict[str, Any]:
    """The bundled SmolLM2 GGUF's tokenizer.* metadata, as is."""
    from chatloom.models.gguf_loader import open_gguf
    from chatloom.models.registry import smollm2_path

    meta = {k: v for k, v in open_gguf(smollm2_path()).metadata.items() if k.startswith("tokenizer.")}
    n = len(meta.get("tokenizer.ggml.tokens", []))
    if n != shape.config["vocab_size"]:
        raise CheckpointError(f"{shape.name}: vocab_size {shape.config['vocab_size']} differs from the bundled "
                              f"SmolLM2 tokenizer's {n} tokens; use tokenizer='byte'")
    return meta


def tokenizer_metadata(shape: Shape) -> dict[str, Any]:
    """The GGUF tokenizer.* keys of a shape's tokenizer (the Hugging Face files are made from them)."""
    if shape.tokenizer == "smollm2":
        return _smollm2_metadata(shape)
    if shape.tokenizer == "byte":
        return _byte_level_metadata(shape)
    raise CheckpointError(f"{shape.name}: unknown tokenizer kind {shape.tokenizer!r} (smollm2, byte)")


def _write_hf_tokenizer(meta: dict[str, Any], folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json: the tokenizer chatloom reads from the GGUF metadata."""
    from chatloom.models.tokenizer import from_gguf

    tok = from_gguf(SimpleNamespace(metadata=meta))
    tok.tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token or None,
              "eos_token": tok.eos_token, "add_bos_token": tok.add_bos,
              "chat_template": meta.get("tokenizer.chat_template") or None, "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# -- the Hugging Face folder -------------------------------------------------------------------------

def write_hf(shape: Shape, folder: Path, seed: int, meta: dict[str, Any]) -> None:
    """config.json, bfloat16 safetensors in shards of about 2 GiB (with their index), tokenizer files."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shapes = hf_tensor_shapes(shape)
    shards: list[list[str]] = [[]]
    size = 0
    for name, dims in shapes.items():
        nbytes = 2 * math.prod(dims)
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    index: dict[str, str] = {}
    for n, names in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: weight(name, shapes[name], seed) for name in names}, str(folder / file),
                  metadata={"format": "pt"})
        index.update({name: file for name in names})
    if len(shards) > 1:
        total = sum(2 * math.prod(d) for d in shapes.values())
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(shape.config, indent=2) + "\n")
    eos = shape.config.get("eos_token_id")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": shape.config.get("bos_token_id"), "eos_token_id": eos}, indent=2) + "\n")
    _write_hf_tokenizer(meta, folder)


# -- the GGUF file --------------------------------------------------------------------------------------

def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head reordered from halves to interleaved pairs: llama.cpp's layout of a llama
    model's Q and K, for its interleaved RoPE."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _llama3_freq_factors(shape: Shape) -> np.ndarray | None:
    """Llama 3's RoPE scaling as GGUF stores it: one divisor per frequency (rope_freqs.weight)."""
    from chatloom.models.config import RopeScaling
    from chatloom.models.rope import inverse_frequencies

    cfg = shape.config
    scaling = RopeScaling.from_hf(cfg.get("rope_scaling"))
    if scaling.type == "default":
        return None
    if scaling.type != "llama3":
        raise CheckpointError(f"{shape.name}: RoPE scaling {scaling.type!r} is not written to GGUF here (llama3 only)")
    d = _dims(cfg)[4]
    trained = cfg["max_position_embeddings"]
    plain, _ = inverse_frequencies(d, float(cfg["rope_theta"]), RopeScaling(), trained)
    scaled, _ = inverse_frequencies(d, float(cfg["rope_theta"]), scaling, trained)
    return (plain / scaled).to(torch.float32).numpy()


def _gguf_tensors(shape: Shape, seed: int) -> Iterator[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]]:
    """(GGUF name, numpy shape, dtype, a maker of its values) per tensor, in llama.cpp's order."""
    from gguf.constants import MODEL_TENSOR as T, TENSOR_NAMES

    hidden, _, heads, kv, _, _ = _dims(shape.config)
    permute = shape.family == "llama"
    shapes = hf_tensor_shapes(shape)

    def values(hf: str, heads_of: int = 0) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            w = weight(hf, shapes[hf], seed)
            if heads_of and permute:
                w = _permute(w, heads_of)
            f32 = w.ndim == 1  # llama.cpp keeps norms and biases in float32
            return w.to(torch.float32 if f32 else torch.float16).numpy()
        return make

    def entry(name: str, hf: str, heads_of: int = 0):
        dims = shapes[hf]
        return name, dims, np.dtype(np.float32 if len(dims) == 1 else np.float16), values(hf, heads_of)

    factors = _llama3_freq_factors(shape)
    if factors is not None:
        yield TENSOR_NAMES[T.ROPE_FREQS] + ".weight", factors.shape, np.dtype(np.float32), lambda: factors
    yield entry(TENSOR_NAMES[T.TOKEN_EMBD] + ".weight", "model.embed_tokens.weight")
    for i in range(shape.config["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def blk(t: T) -> str:
            return TENSOR_NAMES[t].format(bid=i)

        yield entry(blk(T.ATTN_NORM) + ".weight", p + "input_layernorm.weight")
        for t, proj, h in ((T.ATTN_Q, "q", heads), (T.ATTN_K, "k", kv), (T.ATTN_V, "v", 0)):
            yield entry(blk(t) + ".weight", p + f"self_attn.{proj}_proj.weight", h)
            if p + f"self_attn.{proj}_proj.bias" in shapes:
                yield entry(blk(t) + ".bias", p + f"self_attn.{proj}_proj.bias", h)
        yield entry(blk(T.ATTN_OUT) + ".weight", p + "self_attn.o_proj.weight")
        yield entry(blk(T.FFN_NORM) + ".weight", p + "post_attention_layernorm.weight")
        yield entry(blk(T.FFN_GATE) + ".weight", p + "mlp.gate_proj.weight")
        yield entry(blk(T.FFN_UP) + ".weight", p + "mlp.up_proj.weight")
        yield entry(blk(T.FFN_DOWN) + ".weight", p + "mlp.down_proj.weight")
    yield entry(TENSOR_NAMES[T.OUTPUT_NORM] + ".weight", "model.norm.weight")
    if "lm_head.weight" in shapes:
        yield entry(TENSOR_NAMES[T.OUTPUT] + ".weight", "lm_head.weight")


def _add_metadata(writer: Any, key: str, value: Any) -> None:
    """One metadata value with its GGUF type inferred as llama.cpp expects it (ids uint32, token
    types int32, lists of strings as string arrays)."""
    from gguf.constants import GGUFValueType as V

    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list) and value:
        sub = V.STRING if isinstance(value[0], str) else V.FLOAT32 if isinstance(value[0], float) else V.INT32
        writer.add_key_value(key, value, V.ARRAY, sub_type=sub)


def write_gguf(shape: Shape, path: Path, seed: int, meta: dict[str, Any], tensors: Callable = _gguf_tensors,
               file_type: Any = None) -> None:
    """A GGUF F16 file of the shape, one tensor in memory at a time. `tensors` and `file_type` write
    other types: a tensor whose dtype is a GGML quantization type is written as its blocks' bytes
    (kquant_checkpoints.py)."""
    import gguf

    cfg = shape.config
    hidden, inter, heads, kv, d, vocab = _dims(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), shape.family)
    w.add_name(shape.name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if file_type is None else file_type)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(vocab)
    for key, value in meta.items():
        _add_metadata(w, key, value)
    tensors = list(tensors(shape, seed))
    for name, dims, dtype, _ in tensors:
        if isinstance(dtype, gguf.GGMLQuantizationType):  # [rows, weights] stored as rows of blocks
            block, block_bytes = gguf.GGML_QUANT_SIZES[dtype]
            rows, row_bytes = dims[0], dims[1] // block * block_bytes
            w.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, raw_dtype=dtype)
        else:
            w.add_tensor_info(name, dims, dtype, math.prod(dims) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, make in tensors:
        w.write_tensor_data(make())
    w.close()


# -- both ---------------------------------------------------------------------------------------------

@dataclass
class Checkpoint:
    hf_folder: Path
    gguf_file: Path
    parameters: int


def make_checkpoint(shape: Shape, out_dir: Path, seed: int = 0) -> Checkpoint:
    """Write `shape` under out_dir as NAME-hf/ and NAME-f16.gguf."""
    from chatloom.models.config import ModelError
    from chatloom.models.hf_config import config_from_hf

    try:
        config_from_hf(shape.config, shape.name)  # a shape chatloom cannot run is refused before any write
    except ModelError as exc:
        raise CheckpointError(f"{shape.name}: {exc}") from None
    meta = tokenizer_metadata(shape)
    out_dir = Path(out_dir)
    folder, file = out_dir / f"{shape.name}-hf", out_dir / f"{shape.name}-f16.gguf"
    write_hf(shape, folder, seed, meta)
    write_gguf(shape, file, seed, meta)
    params = sum(math.prod(d) for d in hf_tensor_shapes(shape).values())
    return Checkpoint(folder, file, params)
