"""`chatloom bench checkpoints --random-q4-k-m`: llama.cpp's Q4_K_M tensor types with random block bytes,
which chatloom loads and runs with finite outputs."""
from __future__ import annotations

import json

import torch

from chatloom.bench.checkpoints import SHAPES, shrink
from chatloom.bench.kquant_checkpoints import q4_k_m_type, write_random_q4_k_m
from chatloom.cli.main import main
from chatloom.models.gguf_loader import open_gguf
from chatloom.models.loader import load_model

# Rows of 256 depths (one super-block) and 8 layers, so that both kinds of V and down projection occur.
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512)


def test_the_file_has_q4_k_m_types_and_runs(tmp_path):
    shape = shrink(SHAPES["llama3.2-3b"], **SMALL)
    path = tmp_path / "small.gguf"
    size = write_random_q4_k_m(shape, path, seed=1)
    assert size == path.stat().st_size

    kinds = {t.name: t.tensor_type.name for t in open_gguf(path).tensors}
    assert kinds["token_embd.weight"] == "Q6_K"  # tied: the output head too
    assert kinds["blk.0.attn_q.weight"] == kinds["blk.1.ffn_gate.weight"] == "Q4_K"
    # llama.cpp's layers with more bits, of 8: the first, every third from the second, the last.
    assert [kinds[f"blk.{i}.attn_v.weight"] for i in range(8)] == ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K",
                                                                   "Q6_K", "Q6_K"]
    assert all(kinds[f"blk.{i}.ffn_down.weight"] == kinds[f"blk.{i}.attn_v.weight"] for i in range(8))
    assert kinds["blk.0.attn_norm.weight"] == kinds["output_norm.weight"] == "F32"
    assert q4_k_m_type("blk.27.ffn_down.weight", 28).name == "Q6_K"

    loaded = load_model(str(path))
    ids = loaded.tokenizer.encode("The quick brown fox")
    logits = loaded.model.dense_logits([ids])[0]
    assert torch.isfinite(logits).all()


def test_the_command_writes_one_file_per_shape(tmp_path, capsys, monkeypatch):
    import chatloom.bench.checkpoints as checkpoints

    monkeypatch.setitem(checkpoints.SHAPES, "llama3.2-3b", shrink(SHAPES["llama3.2-3b"], **SMALL))
    assert main(["bench", "checkpoints", "--shapes", "llama3.2-3b", "--random-q4-k-m", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)["checkpoints"]["llama3.2-3b"]
    assert report["gguf_bytes"] == (tmp_path / "llama3.2-3b-q4_k_m-random.gguf").stat().st_size
    assert not list(tmp_path.glob("*-hf"))  # the F16 file and the folder are not written
