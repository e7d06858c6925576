"""Our decoder and GGUF loader against Hugging Face transformers, on the bundled model.

transformers reads the same GGUF file with its own code (metadata, dequantization,
undoing llama.cpp's Q/K permutation) and runs its own LlamaForCausalLM; our batched
forward pass must give the same logits.
"""
from __future__ import annotations

import functools

import pytest
import torch

from chatloom.models.registry import smollm2_path

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello",
    "The capital of France is",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "1 2 3 4 5 6 7 8 9 10 11 12",
]


@pytest.fixture(scope="module")
def hf_gguf():
    """(transformers model, transformers tokenizer) read from the bundled GGUF file."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    folder, name = str(path.parent), path.name
    cached_reader = functools.lru_cache(maxsize=1)(gguf.GGUFReader)
    with pytest.MonkeyPatch.context() as mp:
        # transformers opens the file once for the config, once for the tokenizer and once
        # for the weights, and rebuilds gguf's tensor name map for every submodule: parse
        # once and memoize, which saves most of a minute and changes no result.
        mp.setattr(gguf, "GGUFReader", cached_reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # The reference: LlamaForCausalLM via from_pretrained(folder, gguf_file=...).
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cached_reader.cache_clear()
    assert model.config.model_type == "llama"
    return model.eval(), tokenizer


def test_config_matches_transformers(smollm2, hf_gguf):
    hf_cfg = hf_gguf[0].config
    ours = smollm2.config
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers, ours.num_heads,
            ours.num_kv_heads, ours.head_dim, ours.max_position, ours.tie_word_embeddings) == (
        hf_cfg.vocab_size, hf_cfg.hidden_size, hf_cfg.intermediate_size, hf_cfg.num_hidden_layers,
        hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads, hf_cfg.head_dim,
        hf_cfg.max_position_embeddings, hf_cfg.tie_word_embeddings)
    assert ours.rope_theta == pytest.approx(hf_cfg.rope_parameters["rope_theta"])
    assert ours.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)


def test_tokenizer_matches_transformers(smollm2, hf_gguf):
    hf_tok = hf_gguf[1]
    for text in TEXTS + ["  leading spaces, tabs\tand 12345 digits ✓ 🙂"]:
        assert smollm2.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False), text


@torch.inference_mode()
def test_logits_match_transformers(smollm2, hf_gguf):
    model = hf_gguf[0]
    seqs = [smollm2.tokenizer.encode(t) for t in TEXTS]
    assert len({len(s) for s in seqs}) == len(seqs)  # different lengths in one batch
    ours = smollm2.model.dense_logits(seqs)
    for seq, mine in zip(seqs, ours):
        theirs = model(torch.tensor([seq])).logits[0]
        assert mine.shape == theirs.shape
        diff = float((mine.float() - theirs).abs().max())
        assert diff < 1e-3, f"max |logit difference| {diff} for {len(seq)} tokens"
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
