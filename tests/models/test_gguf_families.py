"""Every family from a K-quantized GGUF file, against transformers on the same weights.

Each tiny checkpoint is converted the way llama.cpp's converter lays its family out
(tiny_gguf.py: names, Gemma's 1 + w norms, Phi-3's fused tensors, stacked 3-D experts,
metadata) with its matrices in Q4_K, Q5_K and Q6_K, loaded through load_model, and its logits
compared with transformers' implementation of the Hugging Face folder holding gguf's
dequantization of the same blocks. The settings llama.cpp derives rather than stores
(Gemma's sliding pattern and attention scale) are checked on metadata-only files.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

from chatloom.models import describe_config, load_model
from chatloom.models.gguf_loader import open_gguf, read_config
from chatloom.models.kernels import load_kernels
from chatloom.models.memory_check import gguf_weight_bytes
from chatloom.models.packed_linear import KQuantLinear, QuantizedLinear, kquant_matmul_supported

import tiny_checkpoints as tc
import tiny_gguf as tg

pytest.importorskip("transformers")

FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen2_moe", "qwen3_moe"]
SEQS = [list(range(3, 43)), [7, 8, 9], [200, 5, 17, 90, 250, 1, 2, 3, 4, 33, 61, 62, 63, 120]]
kernels = load_kernels()

# What each file must make of its family (else the parity could pass with a feature off).
EXPECT = {
    "llama": dict(rope_interleaved=True, num_experts=0),
    "qwen2": dict(attention_bias=True, rope_interleaved=False),
    "qwen3": dict(qk_norm=True, rope_interleaved=False),
    "gemma2": dict(sandwich_norms=True, hidden_act="gelu_tanh", attn_softcap=5.0, final_softcap=3.0,
                   layer_windows=[6, None], attention_scale=64 ** -0.5, embedding_scale=16.0,
                   tie_word_embeddings=True),
    "gemma3_text": dict(sandwich_norms=True, qk_norm=True, layer_windows=[6] * 5 + [None],
                        rope_local_theta=10000.0, rope_theta=1000.0, final_softcap=None),
    "phi3": dict(layer_windows=[12, 12], qk_norm=False, rope_interleaved=False),
    "mixtral": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=256,
                    rope_interleaved=True),
    "qwen2_moe": dict(num_experts=4, norm_topk_prob=False, shared_expert_intermediate_size=256,
                      moe_layers=[True, False], attention_bias=True),
    "qwen3_moe": dict(num_experts=4, norm_topk_prob=True, qk_norm=True, moe_layers=[True, True]),
}


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(family, GGUF path, transformers model on the dequantized weights)."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    cfg = tg.kquant_config(arch)
    ref = tg.kquant_gguf(root / f"{arch}.gguf", cfg, seed=4)
    folder = tc.write_hf_folder(root / "hf", cfg, ref)
    return arch, root / f"{arch}.gguf", tc.transformers_model(folder)


def test_kquant_gguf_matches_transformers(checkpoint, caplog):
    arch, path, hf = checkpoint
    with caplog.at_level(logging.INFO):
        loaded = load_model(str(path), "fp32")
    cfg = loaded.config
    assert cfg.architecture == arch
    for key, value in EXPECT[arch].items():
        assert getattr(cfg, key) == value, key
    ours = loaded.model.dense_logits(SEQS)
    theirs = tc.transformers_logits(hf, SEQS)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) < 1e-3
    if kernels is None:
        return
    assert "dequantizing" not in caplog.text  # every matrix kept its blocks
    layer = loaded.model.layers[0]
    mlp = layer.mlp
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, loaded.model.lm_head]
    if cfg.num_experts:  # each expert of the stacked 3-D tensors is a quantized layer of its own
        linears += [m for e in mlp.experts for m in (e.gate_up_proj, e.down_proj)]
        if mlp.shared_expert is not None:
            linears += [mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj]
    else:
        linears += [mlp.gate_up_proj, mlp.down_proj]
    # Q4_K and Q6_K layers keep their super-blocks where the CPU runs that kernel, the rest 32-weight groups.
    assert all(isinstance(m, (QuantizedLinear, KQuantLinear)) for m in linears)
    assert any(isinstance(m, KQuantLinear) for m in linears) == kquant_matmul_supported(kernels)


def test_memory_estimate_is_what_the_model_holds(checkpoint):
    """The memory check's estimate (stacked K-quant experts at their kept layout, fused
    layers of mixed types in the grouped one) is the bytes the loaded model really holds."""
    arch, path, _ = checkpoint
    tensors = open_gguf(path).tensors
    kept, dense = gguf_weight_bytes(tensors, 4, True, kquant_matmul_supported(kernels)), gguf_weight_bytes(tensors, 4, False)
    assert kept < dense * 0.5
    assert describe_config(str(path)).architecture == arch
    if kernels is None:
        return
    model, held, seen = load_model(str(path), "fp32").model, 0, set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is not None and "rope" not in name and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            held += t.numel() * t.element_size()
    assert abs(kept - held) < 0.02 * held  # tiny routers padded to a 16-row panel: the rest


@pytest.mark.skipif(kernels is None or not kernels.int8_linear_supported(), reason="no int8 kernels")
def test_memory_estimate_in_the_int8_mode_is_what_the_model_holds(checkpoint):
    """The layout `gguf_layout` predicts for the int8 mode (super-blocks where the CPU has that kernel)
    is what the loaded model holds, so the memory check and `chatloom capacity` count the right bytes."""
    from chatloom.models.loader import gguf_layout

    _, path, _ = checkpoint
    reader = open_gguf(path)
    keeps, int8, super_blocks = gguf_layout(reader, torch.float32, True, False)
    assert keeps and int8
    estimate = gguf_weight_bytes(reader.tensors, 4, keeps, super_blocks, int8_activations=int8)
    model, held, seen = load_model(str(path), "fp32", int8_matmul=True).model, 0, set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is not None and "rope" not in name and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            held += t.numel() * t.element_size()
    assert abs(estimate - held) < 0.02 * held


@pytest.mark.skipif(kernels is None, reason="C++ kernels unavailable")
@pytest.mark.parametrize("arch", ["qwen2_moe", "gemma3_text"])
def test_engine_batched_equals_alone(arch, tmp_path):
    """Batched, chunked, prefix-shared decoding of a quantized MoE / sliding-window GGUF gives
    each prompt what it gives alone."""
    from chatloom.engine import EngineConfig, LLMEngine, SamplingParams

    cfg = tg.kquant_config(arch)
    path = tmp_path / "m.gguf"
    tg.kquant_gguf(path, cfg, seed=8)
    loaded = load_model(str(path), "fp32")
    rng = random.Random(5)
    shared = [rng.randrange(250) for _ in range(12)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(250) for _ in range(rng.randrange(2, 14))]
               for i in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    config = EngineConfig(block_size=4, num_blocks=48, max_num_batched_tokens=9, max_num_seqs=4)
    batched = LLMEngine(loaded, config).generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, batched):
        alone = LLMEngine(loaded, config).generate([prompt], params, use_tqdm=False)[0]
        assert alone.token_ids == out.token_ids


def test_older_mixtral_files_with_one_tensor_per_expert(tmp_path):
    cfg = tg.kquant_config("mixtral")
    ref = tg.kquant_gguf(tmp_path / "m.gguf", cfg, seed=6, stack_experts=False)
    names = {t.name for t in open_gguf(tmp_path / "m.gguf").tensors}
    assert "blk.1.ffn_down.3.weight" in names and not any("_exps" in n for n in names)
    folder = tc.write_hf_folder(tmp_path / "hf", cfg, ref)
    loaded = load_model(str(tmp_path / "m.gguf"), "fp32")
    assert loaded.config.num_experts == 4
    ours, theirs = loaded.model.dense_logits(SEQS), tc.transformers_logits(tc.transformers_model(folder), SEQS)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) < 1e-3


# -- what llama.cpp derives instead of storing --------------------------------------------

def _metadata_only(path, arch: str, layers: int, **keys):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(4608)
    w.add_vocab_size(100)
    w.add_block_count(layers)
    w.add_feed_forward_length(64)
    w.add_head_count(32)
    w.add_head_count_kv(16)
    w.add_key_length(128)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(4096)
    for name, value in keys.items():
        getattr(w, f"add_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_config(open_gguf(path), "m")


def test_gemma_settings_llama_cpp_derives(tmp_path):
    g2 = _metadata_only(tmp_path / "a.gguf", "gemma2", 4)
    assert g2.layer_windows == [4096, None, 4096, None]
    assert g2.attention_scale == 128 ** -0.5  # head_dim
    big = _metadata_only(tmp_path / "b.gguf", "gemma2", 46)  # Gemma 2 27B: hidden / heads
    assert big.attention_scale == (4608 // 32) ** -0.5
    g3 = _metadata_only(tmp_path / "c.gguf", "gemma3", 12)
    assert g3.layer_windows == ([4096] * 5 + [None]) * 2 and g3.rope_local_theta == 10000.0
    stated = _metadata_only(tmp_path / "d.gguf", "gemma3", 3, sliding_window_pattern=[True, False, False],
                            rope_freq_base_swa=500.0)
    assert stated.layer_windows == [4096, None, None] and stated.rope_local_theta == 500.0
    # Qwen2 files may carry a window that transformers ignores: not applied.
    assert _metadata_only(tmp_path / "e.gguf", "qwen2", 2).layer_windows is None


def test_refused_gguf_variants(tmp_path):
    from chatloom.models import ModelError

    with pytest.raises(ModelError, match="gating function"):
        _metadata_only(tmp_path / "a.gguf", "qwen3moe", 2, expert_count=4, expert_used_count=2,
                       expert_gating_func=__import__("gguf").ExpertGatingFuncType.SIGMOID)
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        _metadata_only(tmp_path / "b.gguf", "gpt2", 2)


@pytest.mark.parametrize("prefix", [True, False])
def test_sentencepiece_space_prefix(tmp_path, prefix):
    """Gemma's GGUF tokenizers (SentencePiece, "llama" model) say add_space_prefix = false:
    the text is not given a leading "▁", and decoding keeps a leading space."""
    import gguf

    from chatloom.models.tokenizer import from_gguf

    tokens = ["<unk>", "<bos>", "<eos>", "▁", "h", "i", "hi", "▁hi", "!"] + [f"<0x{b:02X}>" for b in range(256)]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "gemma2")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -1.5, -1.0, -2.0] + [-10.0] * 256)
    w.add_token_types([2, 3, 3] + [1] * 6 + [6] * 256)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_space_prefix(prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = from_gguf(open_gguf(tmp_path / "t.gguf"))
    ids = tok.encode("hi hi!", add_special=False)
    assert [tok.token_text(i) for i in ids] == (["▁hi", "▁hi", "!"] if prefix else ["hi", "▁hi", "!"])
    assert tok.decode(ids) == "hi hi!"
    assert tok.decode(tok.encode(" hi", add_special=False)) == " hi"
