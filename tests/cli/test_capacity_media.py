"""`chatloom capacity` for the shipped SmolVLM, LLaVA-1.5-7B and Whisper configs: the encoder's weights,
the image tokens and their KV cache, the encoder cache, and Whisper's memory per window, by hand."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from test_cli import call

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))


def _json(capsys, *argv: str) -> dict:
    code, out, err = call(capsys, "capacity", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_llava_1_5_7b(capsys):
    r = _json(capsys, "--model", "llava-1.5-7b", "--memory-gb", "16")
    d, i, p, n, h = 1024, 4096, 14, 576, 4096
    clip = d + 3 * p * p * d + (n + 1) * d + 2 * d + 23 * (4 * (d * d + d) + 2 * d * i + i + d + 4 * d)  # 23 of 24 layers
    projector = d * h + h * h + 2 * h
    v = r["vision"]
    assert v["encoder_parameters"] == clip + projector
    assert v["image_tokens"] == 576
    assert r["kv_bytes_per_token"] == 2 * 32 * 32 * 128 * 2  # fp16 with a memory budget
    assert v["kv_bytes_per_image"] == 576 * r["kv_bytes_per_token"]
    assert v["embedding_bytes_per_image"] == 576 * 4096 * 4
    assert v["images_in_encoder_cache"] == 256 * 2**20 // (576 * 4096 * 4)


def test_smolvlm_256m(capsys):
    r = _json(capsys, "--model", "smolvlm-256m", "--memory-gb", "16")
    v = r["vision"]
    assert v["image_tokens"] == (4 * 4 + 1) * (512 // 16) ** 2 // 4 ** 2  # 17 tiles of 64 tokens
    assert r["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert v["kv_bytes_per_image"] == 1088 * r["kv_bytes_per_token"]


def test_whisper_small(capsys):
    r = _json(capsys, "--model", "whisper-small")
    s = r["speech"]
    assert s["cross_attention_bytes_per_window"] == 2 * 12 * 1500 * 768 * 4
    assert s["self_attention_bytes_per_window"] == 2 * 12 * 448 * 768 * 4
    assert s["batch_bytes"] == s["max_batch"] * (s["cross_attention_bytes_per_window"]
                                                 + s["self_attention_bytes_per_window"])
    assert 240e6 < s["parameters"] < 245e6  # whisper-small: about 242 M


def test_the_encoder_count_matches_a_real_checkpoint(capsys, tmp_path):
    """The arithmetic against the parameters a loaded LLaVA holds (the tiny one built with transformers)."""
    import tiny_llava as tl
    from chatloom.models import load_model

    folder = tl.write_llava_folder(tmp_path / "tiny-llava")
    loaded = load_model(str(folder), "fp32")
    r = _json(capsys, "--model", str(folder), "--memory-gb", "1")
    assert r["vision"]["encoder_parameters"] == sum(t.numel() for t in loaded.vision.parameters())
    code, out, _ = call(capsys, "capacity", "--model", str(folder))
    assert code == 0 and "image encoder and projector" in out and "encoder cache" in out
