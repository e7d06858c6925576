"""Loading tiny checkpoints written to disk: Hugging Face folders and GGUF files.

Each loaded model is checked against transformers' implementation of the same
weights, so the loaders (names, fused projections, Q/K permutation, RoPE layout,
attention bias, tied embeddings) and the decoder are checked together.
"""
from __future__ import annotations

import pytest
import torch

from chatloom.models import ModelError, describe_config, load_model
from chatloom.models.chat_template import render_chat

import tiny_checkpoints as tc

pytest.importorskip("transformers")

SEQS = [[5, 70, 200, 12, 261, 9, 44], [100], [262, 263, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
        [33, 34]]
VARIANTS = {
    "llama": tc.hf_config("llama"),
    "llama-tied": tc.hf_config("llama", tie_word_embeddings=True),
    # transformers 5 writes rope_theta inside rope_parameters.
    "llama-rope-parameters": {k: v for k, v in tc.hf_config("llama").items() if k != "rope_theta"}
    | {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "mistral": tc.hf_config("mistral"),
    "qwen2": tc.hf_config("qwen2"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    """(variant, hf folder, gguf path, transformers model) for each architecture variant."""
    name = request.param
    cfg = VARIANTS[name]
    weights = tc.random_weights(cfg, seed=len(name))
    root = tmp_path_factory.mktemp(name)
    folder = tc.write_hf_folder(root / "hf", cfg, weights)
    gguf_path = tc.write_gguf(root / f"{name}.gguf", cfg, weights)
    return name, folder, gguf_path, tc.transformers_model(folder)


def _max_diff(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    assert [o.shape for o in ours] == [t.shape for t in theirs]
    return max(float((o.float() - t).abs().max()) for o, t in zip(ours, theirs))


def test_hf_folder_matches_transformers(checkpoint):
    name, folder, _, hf = checkpoint
    loaded = load_model(str(folder), "fp32")
    cfg = loaded.config
    assert cfg.architecture == VARIANTS[name]["model_type"]
    assert cfg.rope_theta == (500000.0 if name == "llama-rope-parameters" else 10000.0)
    assert cfg.attention_bias == (name == "qwen2")
    assert cfg.tie_word_embeddings == VARIANTS[name]["tie_word_embeddings"]
    assert not cfg.rope_interleaved
    ours = loaded.model.dense_logits(SEQS)
    assert _max_diff(ours, tc.transformers_logits(hf, SEQS)) < 1e-4


def test_gguf_file_matches_transformers(checkpoint):
    name, _, gguf_path, hf = checkpoint
    loaded = load_model(str(gguf_path), "fp32")
    cfg = loaded.config
    assert cfg.rope_theta == (500000.0 if name == "llama-rope-parameters" else 10000.0)
    # llama.cpp permutes Q/K of llama-style models only; qwen2 keeps the HF layout.
    assert cfg.rope_interleaved == (name != "qwen2")
    assert cfg.attention_bias == (name == "qwen2")
    assert cfg.tie_word_embeddings == VARIANTS[name]["tie_word_embeddings"]
    ours = loaded.model.dense_logits(SEQS)
    assert _max_diff(ours, tc.transformers_logits(hf, SEQS)) < 1e-4


def test_describe_config_reads_no_weights(checkpoint):
    name, folder, gguf_path, _ = checkpoint
    for spec in (folder, gguf_path, folder / "config.json"):
        cfg = describe_config(str(spec))
        assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 8)
        assert cfg.kv_bytes_per_token("fp32") == 2 * 2 * 2 * 8 * 4
        assert cfg.max_position == 128


def test_tokenizers_agree_between_formats(checkpoint):
    _, folder, gguf_path, _ = checkpoint
    from_folder = load_model(str(folder), "fp32").tokenizer
    from_gguf = load_model(str(gguf_path), "fp32").tokenizer
    reference = tc.build_tokenizer()
    texts = ["the theory in a bear", "  spaces\tand\nnewlines  ", "héllo wörld ✓ 🙂", "12345 + 678",
             "<|im_start|>user\nhi<|im_end|>\n"]
    for text in texts:
        want = reference.encode(text, add_special_tokens=False).ids
        assert from_folder.encode(text) == want
        assert from_gguf.encode(text) == want
        assert from_gguf.decode(want, skip_special=False) == text
    im_end = tc.vocab_tokens().index("<|im_end|>")
    for tok in (from_folder, from_gguf):
        assert im_end in tok.eos_token_ids
        assert tok.encode("<|im_start|>") == [tc.vocab_tokens().index("<|im_start|>")]
        assert tok.chat_template == tc.CHAT_TEMPLATE
        prompt = render_chat(tok.chat_template, [{"role": "user", "content": "hi"}])
        assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert tok.decode(tok.encode(prompt)) == "user\nhi\nassistant\n"  # specials skipped


@pytest.mark.parametrize("pre, pieces", [
    ("default", ["123", "4", "5", "12", "Ġabc"]),  # GPT-2: a run of digits is one piece
    ("llama-bpe", ["123", "4", "5", "1", "2", "Ġabc"]),  # Llama 3: groups of up to three digits
    ("qwen2", ["1", "2", "3", "4", "5", "1", "2", "Ġabc"]),  # single digits
    ("smollm", ["1", "2", "3", "4", "5", "1", "2", "Ġabc"]),
])
def test_gguf_pre_tokenizers(tmp_path, pre, pieces):
    from chatloom.models.gguf_loader import open_gguf
    from chatloom.models.tokenizer import from_gguf

    cfg = VARIANTS["llama"]
    path = tc.write_gguf(tmp_path / f"{pre}.gguf", cfg, tc.random_weights(cfg), pre=pre)
    tok = from_gguf(open_gguf(path))
    ids = tok.encode("1234512 abc")
    got = [tok.token_text(i) for i in ids]
    # "Ġabc" is not one token in the tiny vocabulary: compare after joining the tail.
    assert got[:len(pieces) - 1] == pieces[:-1] and "".join(got[len(pieces) - 1:]) == pieces[-1]
    assert tok.decode(ids) == "1234512 abc"


# -- bad files ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_files(tmp_path_factory):
    cfg = VARIANTS["llama"]
    weights = tc.random_weights(cfg)
    root = tmp_path_factory.mktemp("bad")
    return tc.write_hf_folder(root / "hf", cfg, weights), tc.write_gguf(root / "ok.gguf", cfg, weights), root


@pytest.mark.parametrize("cut", [10, 200, 0.5, -4])
def test_truncated_gguf_is_a_model_error(llama_files, cut):
    _, gguf_path, root = llama_files
    data = gguf_path.read_bytes()
    n = int(len(data) * cut) if isinstance(cut, float) else cut
    bad = root / f"cut{cut}.gguf"
    bad.write_bytes(data[:n])
    with pytest.raises(ModelError, match="cannot read GGUF file"):
        load_model(str(bad))


def test_not_a_gguf_file(tmp_path):
    for content in (b"", b"hello, not a model\n" * 10):
        p = tmp_path / "x.gguf"
        p.write_bytes(content)
        with pytest.raises(ModelError, match="cannot read GGUF file"):
            load_model(str(p))
        with pytest.raises(ModelError):
            describe_config(str(p))


def test_missing_paths_and_ids(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path, llama_files):
    import json
    import shutil

    folder, _, _ = llama_files
    bad = tmp_path / "gpt2"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        load_model(str(bad))
    with pytest.raises(ModelError, match="unsupported architecture"):
        describe_config(str(bad / "config.json"))


def test_corrupt_or_mismatched_safetensors(tmp_path, llama_files):
    import shutil

    from safetensors.torch import save_file

    folder, _, _ = llama_files
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 3)
    with pytest.raises(ModelError, match="cannot read"):
        load_model(str(bad))
    weights = tc.random_weights(VARIANTS["llama"])
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:, :5].contiguous()
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ModelError, match="shape"):
        load_model(str(bad))
    del weights["model.layers.1.mlp.down_proj.weight"]
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 32)
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ModelError, match="missing"):
        load_model(str(bad))


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 32.0}}, "RoPE scaling 'longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "RoPE scaling 'yarn' needs a positive factor"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"model_type": "gemma3", "text_config": {}}, "vision-language"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ({"num_hidden_layers": 0}, "invalid num_layers"),
    ({"hidden_size": None}, "bad value"),
])
def test_unsupported_hf_configs_are_refused(tmp_path, change, message):
    import json

    (tmp_path / "config.json").write_text(json.dumps(tc.hf_config("llama") | change))
    with pytest.raises(ModelError, match=message):
        describe_config(str(tmp_path))


def test_sliding_window_is_kept_per_layer(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(tc.hf_config("mistral", sliding_window=64)))
    cfg = describe_config(str(tmp_path))
    assert (cfg.max_position, cfg.layer_windows) == (128, [64, 64])
    (tmp_path / "config.json").write_text(json.dumps(tc.hf_config("qwen2", sliding_window=64)))
    assert describe_config(str(tmp_path)).layer_windows is None  # use_sliding_window is false
