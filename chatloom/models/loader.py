"""One entry point: a registry id or a path in, a ready model and tokenizer out."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from chatloom.models import gguf_loader, hf_loader
from chatloom.models.config import ModelConfig, ModelError
from chatloom.models.hf_config import read_config_file
from chatloom.models.llama import LlamaForCausalLM
from chatloom.models.kernels import load_kernels
from chatloom.models.panel_cache import PanelCache
from chatloom.models.memory_check import check_fits, dense_weight_bytes, gguf_weight_bytes, vision_weight_bytes
from chatloom.models.packed_linear import (QUANTIZED_KINDS, kernels_can_pack, kquant_int8_by_default,
                                          kquant_int8_supported, kquant_matmul_supported)
from chatloom.models.registry import DEFAULT_MODEL, REGISTRY, smollm2_path, tiny_random_config
from chatloom.models.tokenizer import TextTokenizer, from_gguf, from_hf_folder
from chatloom.models.weights import build_model, random_model
from chatloom.models.vision.idefics3 import Idefics3Vision, build_vision, text_weight_getter

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp64": torch.float64, "float64": torch.float64}


@dataclass
class LoadedModel:
    id: str
    model: LlamaForCausalLM
    tokenizer: TextTokenizer
    config: ModelConfig
    load_seconds: float = 0.0
    # The image side of a vision-language model (None: the model takes text only).
    vision: Idefics3Vision | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r} (use fp32 or bf16)")
    return DTYPES[dtype]


def _byte_tokenizer() -> TextTokenizer:
    """256 byte tokens plus ChatML specials: enough text handling for the random test model."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    ids = [tok.token_to_id(s) for s in specials]
    return TextTokenizer(tok, bos_token_id=None, eos_token_ids=[ids[2]], chat_template=None,
                         eos_token="<|im_end|>", special_ids=set(ids))


_FLOAT_KINDS = ("F32", "F16", "BF16", "F64")


def _log_dequantized(kinds: dict[str, str], dtype: torch.dtype) -> None:
    """Say which quantized tensors are expanded to floats at load, and why."""
    if dtype != torch.float32:
        lossy = sorted({k for k in kinds.values() if k not in _FLOAT_KINDS})
        if lossy:
            log.info("dequantizing %s weights at load: quantized matmuls run in float32 models only",
                     ", ".join(lossy))
        return
    counts: dict[str, int] = {}
    for kind in kinds.values():
        if kind not in _FLOAT_KINDS and kind not in QUANTIZED_KINDS:
            counts[kind] = counts.get(kind, 0) + 1
    if counts:
        log.warning("dequantizing %s to float32 at load: no matmul kernel for %s (kept quantized: %s)",
                    ", ".join(f"{n} {k} tensors" for k, n in sorted(counts.items())),
                    "this type" if len(counts) == 1 else "these types", ", ".join(QUANTIZED_KINDS))


def describe_config(spec: str) -> ModelConfig:
    """The architecture of a model without loading its weights (for `models` and `capacity`)."""
    if spec == "tiny-random":
        cfg = tiny_random_config()
        cfg.vocab_size = _byte_tokenizer().vocab_size  # as load_model builds it
        return cfg
    path = smollm2_path() if spec == DEFAULT_MODEL else Path(spec)
    if path.suffix == ".json" and path.is_file():
        return read_config_file(path)
    if path.is_dir():
        return hf_loader.read_config(path)
    if path.is_file():
        return gguf_loader.read_config(gguf_loader.open_gguf(path), path.stem)
    raise _unknown(spec)


def _unknown(spec: str) -> ModelError:
    if "/" in spec or "\\" in spec or Path(spec).suffix in (".gguf", ".json", ".safetensors"):
        return ModelError(f"model file or folder not found: {spec}")
    return ModelError(f"unknown model {spec!r}: not a registry id ({', '.join(REGISTRY)}) "
                      "nor an existing GGUF file or Hugging Face folder")


def gguf_layout(reader, torch_dtype: torch.dtype, int8_matmul: bool | None,
                bf16_matmul: bool) -> tuple[bool, bool, bool]:
    """How a GGUF file's matmul weights are kept once loaded: (quantized blocks kept, int8 activations,
    Q4_K/Q6_K in their super-blocks), decided as packed_linear.pack_linears decides it. `int8_matmul`
    None is the default: on for files mostly in K-quants where packed_linear.kquant_int8_by_default says."""
    kernels = load_kernels()
    keeps = torch_dtype == torch.float32 and kernels_can_pack(kernels)
    if int8_matmul is None:
        int8_matmul = keeps and not bf16_matmul and _mostly_kquants(reader) and kquant_int8_by_default(kernels)
    # Super-blocks serve the exact mode and, where its kernel exists, the int8 one (as packing does).
    super_blocks = keeps and not bf16_matmul and kquant_matmul_supported(kernels) \
        and (not int8_matmul or kquant_int8_supported(kernels))
    return keeps, bool(int8_matmul), super_blocks


def load_model(spec: str = DEFAULT_MODEL, dtype: str | torch.dtype = "fp32",
               int8_matmul: bool | None = False,
               kv_cache_bytes: int | Callable[[ModelConfig], int] = 0,
               bf16_matmul: bool = False, weight_cache: Path | None = None) -> LoadedModel:
    """Load a registry model, GGUF file or Hugging Face folder. `int8_matmul` multiplies
    quantized GGUF weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) with int8 activations (faster, slightly
    less exact; off by default; commands resolve their flag and CHATLOOM_MODEL__INT8_MATMUL once, in
    chatloom/model_args.py). `bf16_matmul` keeps every matmul weight in bfloat16 (AVX-512 BF16 where
    the CPU has it; off by default, resolved like int8 in chatloom/model_args.py). `int8_matmul=None` decides by
    the file: on for a GGUF file whose matmul weights are mostly K-quants, where the CPU runs an int8
    kernel for them faster than the exact one (packed_linear.kquant_int8_by_default), as llama.cpp
    multiplies them; off otherwise. Before any weight is read, the weights plus `kv_cache_bytes` (or what it
    returns for the model's config) are checked against the memory available: ModelError if they do not fit.
    `weight_cache` is a folder that keeps a GGUF file's K-quant layers packed between starts
    (panel_cache.py; None packs them at every start, as library callers and tests do by default)."""
    t0 = time.perf_counter()
    torch_dtype = resolve_dtype(dtype)
    if spec == "tiny-random":
        cfg = tiny_random_config()
        tok = _byte_tokenizer()
        cfg.vocab_size = tok.vocab_size
        model = random_model(cfg, torch_dtype, bf16_matmul=bf16_matmul)
        return LoadedModel(spec, model, tok, cfg, time.perf_counter() - t0)
    path = smollm2_path() if spec == DEFAULT_MODEL else Path(spec)
    quantized = None
    panel_cache = None
    norm_offset = 0.0
    float_bytes = torch.empty(0, dtype=torch_dtype).element_size()

    def check(cfg: ModelConfig, weight_bytes: int) -> None:
        kv = kv_cache_bytes(cfg) if callable(kv_cache_bytes) else kv_cache_bytes
        check_fits(f"model {path.name}", weight_bytes, kv)

    vision = None
    if path.is_dir() and (vision_cfg := hf_loader.read_vision_config(path)) is not None:
        cfg = vision_cfg.text
        check(cfg, dense_weight_bytes(cfg, float_bytes) + vision_weight_bytes(vision_cfg, float_bytes))
        tok = from_hf_folder(path, hf_loader.generation_eos(path))
        tensors = hf_loader.read_weights(path)
        vision = build_vision(vision_cfg, path, tensors.get, torch_dtype)
        model = build_model(cfg, text_weight_getter(tensors.get), torch_dtype, bf16_matmul=bf16_matmul)
        return LoadedModel(path.stem, model, tok, cfg, time.perf_counter() - t0, vision)
    if path.is_dir():
        cfg = hf_loader.read_config(path)
        check(cfg, dense_weight_bytes(cfg, float_bytes))
        # Gemma norms multiply by 1 + w; llama.cpp's converter adds the 1 in GGUF files.
        norm_offset = 1.0 if cfg.sandwich_norms else 0.0
        tok = from_hf_folder(path, hf_loader.generation_eos(path))
        weights = hf_loader.read_weights(path)
    elif path.is_file():
        reader = gguf_loader.open_gguf(path)
        cfg = gguf_loader.read_config(reader, path.stem)
        keeps, int8_matmul, super_blocks = gguf_layout(reader, torch_dtype, int8_matmul, bf16_matmul)
        check(cfg, gguf_weight_bytes(reader.tensors, float_bytes, keeps, super_blocks, float_embedding=bf16_matmul,
                                     int8_activations=int8_matmul))
        tok = from_gguf(reader)
        weights = gguf_loader.read_weights(reader, cfg.architecture)
        quantized = gguf_loader.read_quantized(reader, cfg.architecture)
        _log_dequantized(weights.kinds(), torch_dtype)
        if weight_cache is not None and super_blocks:
            panel_cache = PanelCache(weight_cache)
    else:
        raise _unknown(spec)
    model = build_model(cfg, weights.get, torch_dtype, quantized, bool(int8_matmul), norm_offset,
                        bf16_matmul=bf16_matmul, panel_cache=panel_cache)
    if panel_cache is not None and (panel_cache.mapped or panel_cache.written):
        log.info(panel_cache.summary())
    model_id = spec if spec in REGISTRY else path.stem
    return LoadedModel(model_id, model, tok, cfg, time.perf_counter() - t0)


def load_tokenizer(spec: str = DEFAULT_MODEL) -> TextTokenizer:
    """The tokenizer (and chat template) of a model without its weights: a router or gateway
    tokenizes prompts for a model that runs elsewhere (reading GGUF metadata is a memory map)."""
    if spec == "tiny-random":
        return _byte_tokenizer()
    path = smollm2_path() if spec == DEFAULT_MODEL else Path(spec)
    if path.is_dir():
        return from_hf_folder(path, hf_loader.generation_eos(path))
    if path.is_file() and path.suffix != ".json":
        return from_gguf(gguf_loader.open_gguf(path))
    raise _unknown(spec)


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _mostly_kquants(reader) -> bool:
    """Whether most of a GGUF file's quantized 2-D weights (by bytes) are K-quants."""
    kquant = other = 0
    for t in reader.tensors:
        if len(t.shape) < 2:
            continue
        size = t.data.nbytes
        if t.tensor_type.name in K_QUANTS:
            kquant += size
        elif t.tensor_type.name not in ("F32", "F16", "BF16"):
            other += size
    return kquant > other
