"""`chatloom bench checkpoints`: random-weight checkpoints of real shapes, as a Hugging Face folder and
as GGUF F16, that chatloom loads to the same model."""
from __future__ import annotations

import json

import pytest
import torch

from chatloom.bench.checkpoints import SHAPES, CheckpointError, hf_tensor_shapes, make_checkpoint, shrink
from chatloom.cli.main import main
from chatloom.models.gguf_loader import open_gguf
from chatloom.models.loader import load_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
# Each published shape at a test size, keeping what sets it apart: GQA and Llama 3's RoPE scaling,
# Qwen's QKV biases and half-rotation RoPE, SmolLM2's own 49,152-token tokenizer.
SMALL = {
    "llama3.2-3b": dict(TINY, num_key_value_heads=2, head_dim=16, vocab_size=512),
    "qwen2.5-1.5b": dict(TINY, num_key_value_heads=2, vocab_size=512),
    "smollm2-1.7b": dict(TINY, num_key_value_heads=4),
}


@pytest.fixture(scope="module", params=sorted(SMALL))
def written(request, tmp_path_factory):
    shape = shrink(SHAPES[request.param], **SMALL[request.param])
    return shape, make_checkpoint(shape, tmp_path_factory.mktemp(request.param), seed=3)


def test_published_shapes_have_their_sizes():
    billions = {n: sum(torch.Size(d).numel() for d in hf_tensor_shapes(s).values()) / 1e9 for n, s in SHAPES.items()}
    assert 1.6 < billions["smollm2-1.7b"] < 1.8
    assert 1.4 < billions["qwen2.5-1.5b"] < 1.6
    assert 3.1 < billions["llama3.2-3b"] < 3.3  # 3.21B with the embedding counted once (tied)


def test_both_files_load_to_the_same_model(written):
    shape, made = written
    hf, gguf = load_model(str(made.hf_folder)), load_model(str(made.gguf_file))
    assert hf.config.tie_word_embeddings and gguf.config.tie_word_embeddings
    assert hf.config.num_kv_heads == gguf.config.num_kv_heads == shape.config["num_key_value_heads"]
    assert hf.config.attention_bias == gguf.config.attention_bias == (shape.family == "qwen2")
    text = "The quick brown fox, 12 times."
    ids = hf.tokenizer.encode(text)
    assert ids == gguf.tokenizer.encode(text) and hf.tokenizer.decode(ids) == text
    # The GGUF stops at the end-of-turn token as llama.cpp's files do; the folder at generation_config's list.
    assert gguf.tokenizer.eos_token_ids and set(gguf.tokenizer.eos_token_ids) <= set(hf.tokenizer.eos_token_ids)
    a, b = hf.model.dense_logits([ids])[0], gguf.model.dense_logits([ids])[0]
    # Random weights at the published scale give logits of order 1, not a flat or exploding model.
    assert 0.3 < a.abs().max().item() < 10 and a.std().item() > 0.05
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_gguf_is_laid_out_as_llama_cpp_writes_it(written):
    shape, made = written
    reader = open_gguf(made.gguf_file)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight"] == kinds["token_embd.weight"] == "F16"
    assert kinds["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" not in kinds  # tied embeddings
    assert ("rope_freqs.weight" in kinds) == (shape.config.get("rope_scaling") is not None)
    assert len(reader.metadata["tokenizer.ggml.tokens"]) == shape.config["vocab_size"]
    assert reader.metadata["general.architecture"] == shape.family


def test_weights_follow_the_seed(tmp_path):
    shape = shrink(SHAPES["qwen2.5-1.5b"], **SMALL["qwen2.5-1.5b"])
    one = make_checkpoint(shape, tmp_path / "a", seed=1).gguf_file.read_bytes()
    assert make_checkpoint(shape, tmp_path / "b", seed=1).gguf_file.read_bytes() == one
    assert make_checkpoint(shape, tmp_path / "c", seed=2).gguf_file.read_bytes() != one


def test_a_vocabulary_the_bundled_tokenizer_lacks_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="byte"):
        make_checkpoint(shrink(SHAPES["smollm2-1.7b"], **dict(SMALL["smollm2-1.7b"], vocab_size=512)), tmp_path)
    assert not any(tmp_path.iterdir())


def test_cli_names_an_unknown_shape(tmp_path, capsys):
    assert main(["bench", "checkpoints", "--shapes", "gpt-5", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "gpt-5" in err and "llama3.2-3b" in err and len(err.strip().splitlines()) == 1


def test_cli_writes_a_checkpoint(tmp_path, capsys, monkeypatch):
    from chatloom.bench import checkpoints

    small = shrink(SHAPES["qwen2.5-1.5b"], **SMALL["qwen2.5-1.5b"])
    monkeypatch.setitem(checkpoints.SHAPES, "qwen2.5-1.5b", small)
    assert main(["bench", "checkpoints", "--shapes", "qwen2.5-1.5b", "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)["checkpoints"]["qwen2.5-1.5b"]
    assert out["gguf_bytes"] > 2 * out["parameters"] and (tmp_path / "qwen2.5-1.5b-small-hf" / "config.json").exists()


def test_every_token_a_random_model_draws_has_text(written):
    """Filler ids stream visible text from both files: a server sends nothing for a token without text,
    and a benchmark would have no tokens to time."""
    shape, made = written
    if shape.tokenizer != "byte":
        pytest.skip("SmolLM2's own vocabulary has no filler")
    meta = open_gguf(made.gguf_file).metadata
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    fillers = [i for i, t in enumerate(tokens) if str(t).startswith("<|unused_")]
    # llama.cpp renders a token of type "unused" (5) or "control" (3) as no text; "normal" (1) as its text.
    assert fillers and {int(types[i]) for i in fillers} == {1}
    filler = fillers[-1]
    for loaded in (load_model(str(made.hf_folder)), load_model(str(made.gguf_file))):
        assert loaded.tokenizer.decode([filler]) == f"<|unused_{filler}|>"
