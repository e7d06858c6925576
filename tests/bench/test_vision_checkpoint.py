"""`chatloom bench checkpoints --shapes smolvlm-256m`: SmolVLM-256M's shape with random weights, here
shrunk (same vocabulary, tokenizer and image-token ids), loads in chatloom and answers about an image."""
from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest
from PIL import Image

from chatloom.bench import vision_checkpoint as vc
from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models import load_model
from chatloom.serving.images import IMAGE_MARKER, encode_vision_chat, read_image


def _small_config() -> dict:
    cfg = copy.deepcopy(vc.published_config())
    cfg["scale_factor"] = 2
    cfg["text_config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16)
    cfg["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8)
    return cfg


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    made, params = vc.make_vision_checkpoint(tmp_path_factory.mktemp("vlm"), seed=1, config=_small_config(),
                                             longest_edge=64)
    assert params > 49280 * 64 * 2  # both embedding matrices (untied) at the published vocabulary
    return made


def _image_bytes(side: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_the_published_config_is_smolvlm_256m():
    cfg = vc.published_config()
    assert cfg["model_type"] == "idefics3" and cfg["image_token_id"] == 49190
    assert cfg["text_config"]["vocab_size"] == 49152 + len(vc.added_tokens())


def test_the_checkpoint_loads_in_chatloom_and_answers_about_an_image(folder):
    loaded = load_model(str(folder), "fp32")
    assert loaded.vision is not None
    tok = loaded.tokenizer
    assert tok.encode("<image>") == [49190] and tok.encode("<end_of_utterance>") == [49279]
    assert 49279 in tok.eos_token_ids
    # SmolLM2's own pieces for ordinary text, not bytes.
    assert len(tok.encode("The lighthouse keeper")) <= 4
    # A 64-pixel image: 2 x 2 tiles of 32 and the global view, 4 tokens each after the shuffle.
    assert loaded.vision.num_image_tokens(64, 64) == 5 * 4
    message = {"role": "user", "content": IMAGE_MARKER + "What is it?",
               "images": [read_image(_image_bytes(64), 64 * 64 + 1)]}
    ids, placed = encode_vision_chat(loaded, [message])
    assert ids.count(49190) == 5 * 4
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16))
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), images=placed)
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                done = out
    assert done is not None and len(done.token_ids) == 3 and engine.runner.encoder_runs == 1


def test_the_cli_writes_the_shape_and_refuses_an_unknown_one(tmp_path, monkeypatch, capsys):
    from chatloom.cli.main import main

    calls = []
    monkeypatch.setattr(vc, "make_vision_checkpoint", lambda out, seed: calls.append((out, seed)) or (out / "x", 7))
    assert main(["bench", "checkpoints", "--shapes", "smolvlm-256m", "--out", str(tmp_path), "--seed", "4"]) == 0
    assert calls == [(tmp_path, 4)]
    assert json.loads(capsys.readouterr().out)["checkpoints"]["smolvlm-256m"]["parameters"] == 7
    assert main(["bench", "checkpoints", "--shapes", "smolvlm-1b", "--out", str(tmp_path)]) != 0
    assert "smolvlm-256m" in capsys.readouterr().err
