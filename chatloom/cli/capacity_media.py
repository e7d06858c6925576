"""`chatloom capacity` for models that take images or speech: the memory arithmetic beyond the decoder's.

A vision-language model (Idefics3 / SmolVLM, LLaVA) adds its image encoder and projector to the weights,
a KV cost per image (the image tokens it becomes), and the encoder cache ([engine] encoder_cache_mb) that
keeps each image's embeddings by its hash. Whisper has no paged KV pool: its weights, and per 30-second
window being transcribed the cross-attention keys and values of the encoder's 1,500 positions and its
decoder's self-attention cache, up to [speech] max_batch windows at once.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chatloom.cli.units import fmt_binary, fmt_int

SPEECH = ("whisper",)
VISION = ("idefics3", "smolvlm", "llava")
# The Idefics3 processor's default: the longest edge resized to 4 tiles, so a large photo is 4 x 4 tiles.
IDEFICS3_TILES_PER_SIDE = 4


def raw_config(spec: str) -> dict | None:
    """The config.json of a folder or a config file as a dictionary (None for a GGUF file or an id)."""
    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def vision_report(raw: dict, name: str, float_bytes: int, kv_bytes_per_token: int, cache_mb: float) -> dict[str, Any]:
    """Encoder weights, image tokens, KV per image and the encoder cache for a vision config."""
    from chatloom.models.memory_check import dense_weight_bytes
    from chatloom.models.vision.idefics3 import Idefics3Config
    from chatloom.models.vision.llava import LlavaConfig

    if raw.get("model_type") == "llava":
        cfg = LlavaConfig.from_hf(raw, name)
        tokens, how = cfg.image_seq_len, "every image (resized and cropped to one encoder input)"
    else:
        cfg = Idefics3Config.from_hf(raw, name)
        tiles = IDEFICS3_TILES_PER_SIDE ** 2 + 1
        tokens = tiles * cfg.image_seq_len
        how = (f"a large photo: {IDEFICS3_TILES_PER_SIDE} x {IDEFICS3_TILES_PER_SIDE} tiles and a global view of "
               f"{cfg.image_seq_len} tokens each (a small image: {cfg.image_seq_len})")
    embedding_bytes = tokens * cfg.text.hidden_size * float_bytes
    cache = int(cache_mb * 2**20)
    return {"encoder_parameters": cfg.vision_parameters(),
            "encoder_weight_bytes": cfg.vision_parameters() * float_bytes,
            "decoder_weight_bytes": dense_weight_bytes(cfg.text, float_bytes),
            "weight_float_bytes": float_bytes,
            "image_tokens": tokens, "image_tokens_are": how,
            "kv_bytes_per_image": tokens * kv_bytes_per_token,
            "encoder_cache_bytes": cache, "embedding_bytes_per_image": embedding_bytes,
            "images_in_encoder_cache": cache // embedding_bytes}


def print_vision(v: dict[str, Any]) -> None:
    weights = v["encoder_weight_bytes"] + v["decoder_weight_bytes"]
    kind = "fp32" if v["weight_float_bytes"] == 4 else "bf16"
    print(f"weights ({kind}): decoder {fmt_binary(v['decoder_weight_bytes'])} + image encoder and projector "
          f"{fmt_binary(v['encoder_weight_bytes'])} ({fmt_int(v['encoder_parameters'])} parameters) = "
          f"{fmt_binary(weights)}")
    print(f"image tokens: {fmt_int(v['image_tokens'])} for {v['image_tokens_are']}; "
          f"their KV cache: {fmt_binary(v['kv_bytes_per_image'])} per image")
    print(f"encoder cache: {fmt_binary(v['encoder_cache_bytes'])} ([engine] encoder_cache_mb) holds "
          f"{fmt_int(v['images_in_encoder_cache'])} such images' embeddings "
          f"({fmt_binary(v['embedding_bytes_per_image'])} each)")


def speech_report(raw: dict, max_batch: int, float_bytes: int = 4) -> dict[str, Any]:
    """Whisper's weights and its memory per window being transcribed."""
    from chatloom.models.speech.whisper import WhisperConfig

    cfg = WhisperConfig.from_dict(raw)
    cross = 2 * cfg.decoder_layers * cfg.max_source_positions * cfg.d_model * float_bytes
    own = 2 * cfg.decoder_layers * cfg.max_target_positions * cfg.d_model * float_bytes
    return {"parameters": cfg.num_parameters(), "weight_bytes": cfg.num_parameters() * float_bytes,
            "cross_attention_bytes_per_window": cross, "self_attention_bytes_per_window": own,
            "max_batch": max_batch, "batch_bytes": max_batch * (cross + own),
            "layers": [cfg.encoder_layers, cfg.decoder_layers], "d_model": cfg.d_model}


def print_speech(name: str, s: dict[str, Any]) -> None:
    enc, dec = s["layers"]
    print(f"model: {name} (whisper, {enc} encoder and {dec} decoder layers of width {s['d_model']})")
    print(f"weights (fp32): {fmt_int(s['parameters'])} parameters, {fmt_binary(s['weight_bytes'])}")
    print(f"per 30-second window: cross-attention K/V {fmt_binary(s['cross_attention_bytes_per_window'])} "
          f"(2 x {dec} layers x 1,500 positions x {s['d_model']} x 4 bytes) + self-attention cache up to "
          f"{fmt_binary(s['self_attention_bytes_per_window'])}")
    print(f"a full batch ([speech] max_batch = {s['max_batch']} windows): {fmt_binary(s['batch_bytes'])}; "
          f"with the weights {fmt_binary(s['batch_bytes'] + s['weight_bytes'])}")
    print("no paged KV pool: Whisper does not share the chat engine's cache")
