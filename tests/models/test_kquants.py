"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept quantized and expanded inside the matmul kernels.

The exact mode must give the very bits of gguf's dequantizer followed by the float32 matmul,
at every row count a step can have; the int8-activation mode must stay close to it; and a
Q4_K_M-style GGUF file must load with its matrices kept quantized and match transformers.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from chatloom.models import load_model
from chatloom.models.kernels import load_kernels
from chatloom.models.registry import DEFAULT_MODEL
from chatloom.models.kquant_panels import SUPER_BYTES, kquant_panels_fit, pack_kquant_panels
from chatloom.models.packed_linear import (KQuantLinear, QuantizedLinear, QuantizedWeight, kquant_int8_by_default,
                                           kquant_int8_supported, kquant_matmul_supported, pack_linears,
                                           pack_quantized, pack_weight, quantized_layout)

import tiny_checkpoints as tc

kernels = load_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels unavailable")

ROWS = [1, 2, 3, 4, 5, 6, 7, 12, 13, 31, 64, 97, 200]
K = 512


def _parts(kinds: list[str], sizes: list[int], seed: int = 0) -> list[QuantizedWeight]:
    return [QuantizedWeight(k, tc.random_kquant_blocks(k, n, K, seed + i), n, K)
            for i, (k, n) in enumerate(zip(kinds, sizes))]


CASES = {
    "Q4_K": (["Q4_K"], [40]),
    "Q5_K": (["Q5_K"], [40]),
    "Q6_K": (["Q6_K"], [40]),
    "fused Q4_K+Q4_K+Q6_K (a Q4_K_M QKV)": (["Q4_K", "Q4_K", "Q6_K"], [32, 16, 17]),
    "fused Q5_K+Q4_K": (["Q5_K", "Q4_K"], [20, 13]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_exact_mode_is_bit_identical_to_gguf_dequantize_then_float32(case):
    kinds, sizes = CASES[case]
    parts = _parts(kinds, sizes, seed=len(case))
    dense = torch.cat([tc.dequantize(p.kind, p.raw) for p in parts])
    n = dense.shape[0]
    codes, scales = pack_quantized(parts)
    layer = QuantizedLinear(codes, scales, n, None, kernels)
    assert torch.equal(layer.weight, dense)
    expected_bytes = {"nibbles": K // 2, "int8": K, "grouped": K}[quantized_layout(parts)]
    assert codes[0].numel() * codes.element_size() == expected_bytes * 16  # codes stay 4 or 8 bits
    bias = torch.randn(n)
    panels = pack_weight(dense)
    for rows in ROWS:
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        got = layer(x)
        assert torch.equal(got, kernels.packed_linear(x, panels, n)), rows
        layer.bias = bias
        assert torch.equal(layer(x), kernels.packed_linear(x, panels, n, bias)), rows
        layer.bias = None
        torch.testing.assert_close(got, x @ dense.t(), rtol=1e-4, atol=1e-4)


def test_a_row_does_not_depend_on_the_batch():
    parts = _parts(["Q6_K"], [33])
    codes, scales = pack_quantized(parts)
    x = torch.randn(50, K, generator=torch.Generator().manual_seed(1))
    full = kernels.grouped_quantized_linear(x, codes, scales, 33)
    for i in (0, 3, 4, 49):
        assert torch.equal(kernels.grouped_quantized_linear(x[i:i + 1], codes, scales, 33)[0], full[i])


SUPER_BLOCK_CASES = {
    "Q4_K": (["Q4_K"], [40]),
    "Q6_K": (["Q6_K"], [40]),
    "fused Q4_K+Q4_K+Q6_K (a Q4_K_M QKV)": (["Q4_K", "Q4_K", "Q6_K"], [32, 16, 17]),
    # A task of 4 panels that starts in one kind and ends in the other.
    "fused Q6_K+Q4_K across a task": (["Q6_K", "Q4_K"], [48, 80]),
}
needs_super_blocks = pytest.mark.skipif(not kquant_matmul_supported(kernels),
                                        reason="the super-block K-quant kernel needs AVX-512")


@needs_super_blocks
@pytest.mark.parametrize("case", list(SUPER_BLOCK_CASES))
def test_super_block_panels_are_bit_identical_to_gguf_dequantize_then_float32(case):
    """Q4_K and Q6_K kept in their super-blocks (kquant_panels.py): the file's bytes per weight, and
    the bits of gguf's dequantizer followed by the float32 kernel at every row count."""
    kinds, sizes = SUPER_BLOCK_CASES[case]
    parts = _parts(kinds, sizes, seed=len(case))
    dense = torch.cat([tc.dequantize(p.kind, p.raw) for p in parts])
    n = dense.shape[0]
    layer = KQuantLinear.from_parts(parts, n, None, kernels)
    assert torch.equal(layer.weight, dense)
    panels_of = [-(-p.rows // 16) for p in parts]
    assert layer.blob.numel() == sum(np_ * 16 * K // 256 * SUPER_BYTES[p.kind] // 16
                                     for np_, p in zip(panels_of, parts))
    assert SUPER_BYTES["Q4_K"] * 8 / (16 * 256) == 4.625 and SUPER_BYTES["Q6_K"] * 8 / (16 * 256) == 6.5625
    bias = torch.randn(n)
    panels = pack_weight(dense)
    for rows in ROWS + [8, 9, 10, 11]:
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        got = layer(x)
        assert torch.equal(got, kernels.packed_linear(x, panels, n)), rows
        layer.bias = bias
        assert torch.equal(layer(x), kernels.packed_linear(x, panels, n, bias)), rows
        layer.bias = None
        torch.testing.assert_close(got, x @ dense.t(), rtol=1e-4, atol=1e-4)
        assert torch.equal(layer(x[-1:])[0], got[-1])  # a row alone: the same bits


def test_only_whole_panels_of_q4_k_and_q6_k_take_super_blocks():
    assert kquant_panels_fit(_parts(["Q4_K", "Q6_K"], [32, 17]))
    assert not kquant_panels_fit(_parts(["Q5_K"], [32]))
    assert not kquant_panels_fit(_parts(["Q4_K", "Q6_K"], [20, 16]))  # a panel would hold two kinds
    with pytest.raises(ValueError, match="whole panels"):
        pack_kquant_panels(_parts(["Q4_K", "Q6_K"], [20, 16]))


@needs_super_blocks
def test_pack_linears_keeps_super_blocks_in_exact_mode_only():
    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(K, 40), torch.nn.Linear(K, 33))

    quantized = {"0": _parts(["Q4_K", "Q6_K"], [32, 8]), "1": _parts(["Q5_K", "Q4_K"], [20, 13])}
    exact = model()
    assert pack_linears(exact, quantized)
    assert isinstance(exact[0], KQuantLinear)
    assert isinstance(exact[1], QuantizedLinear)  # Q5_K, and a panel of two kinds: the grouped layout
    if kernels.int8_linear_supported():
        fast = model()
        assert pack_linears(fast, quantized, int8_activations=True)
        # With VNNI the super-blocks stay, multiplied with int8 activations; without, the group layouts.
        kind = KQuantLinear if kquant_int8_supported(kernels) else QuantizedLinear
        assert isinstance(fast[0], kind) and fast[0].int8_activations
        assert isinstance(fast[1], QuantizedLinear) and fast[1].int8_activations


@needs_super_blocks
def test_kquant_linear_names_a_layout_that_does_not_fit():
    layer = KQuantLinear.from_parts(_parts(["Q4_K", "Q6_K"], [32, 17]), 49, None, kernels)
    x = torch.randn(2, K)
    with pytest.raises(RuntimeError, match="does not hold K = 256"):
        kernels.kquant_linear(x[:, :256], layer.blob, layer.offsets, layer.kinds, 49)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        kernels.kquant_linear(x, layer.blob, layer.offsets, layer.kinds, 80)
    with pytest.raises(RuntimeError, match="offsets do not span"):
        kernels.kquant_linear(x, layer.blob[:-1], layer.offsets, layer.kinds, 49)
    kinds = layer.kinds.clone()
    kinds[0] = 7
    with pytest.raises(RuntimeError, match="panel 0"):
        kernels.kquant_linear(x, layer.blob, layer.offsets, kinds, 49)


INT8_CASES = ["Q4_K", "Q5_K", "Q6_K", "fused Q4_K+Q4_K+Q6_K (a Q4_K_M QKV)"]


@pytest.mark.skipif(kernels is None or not kernels.int8_linear_supported(), reason="int8 matmul needs AVX2")
@pytest.mark.parametrize("case", INT8_CASES)
def test_int8_activation_mode_stays_close(case):
    kinds, sizes = CASES[case]
    parts = _parts(kinds, sizes, seed=3)
    n = sum(sizes)
    dense = torch.cat([tc.dequantize(p.kind, p.raw) for p in parts])
    codes, scales = pack_quantized(parts)
    layer = QuantizedLinear(codes, scales, n, None, kernels, int8_activations=True)
    assert layer.int8_activations
    assert torch.equal(layer.weight, dense)
    bias = torch.randn(n)
    full = layer(torch.randn(200, K, generator=torch.Generator().manual_seed(200)))
    for rows in (1, 2, 3, 7, 64, 200):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        exact = x @ dense.t()
        got = layer(x)
        err = (got - exact).norm() / exact.norm()
        assert err < 0.02, (rows, float(err))
        layer.bias = bias
        torch.testing.assert_close(layer(x), got + bias)
        layer.bias = None
    # A row's result does not depend on the rest of the batch.
    x = torch.randn(200, K, generator=torch.Generator().manual_seed(200))
    assert torch.equal(layer(x[5:6])[0], full[5]) and torch.equal(layer(x[:3])[2], full[2])


def _quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 kernel sees it: per block of 32, round(x * 127 / max|x|) * max|x| / 127 (float32
    steps as in kquant_int8.cpp), returned in float64."""
    xb = x.reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).clamp(-127, 127)  # round half to even, as the kernel
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


needs_kquant_int8 = pytest.mark.skipif(not kquant_int8_supported(kernels),
                                       reason="the int8 super-block kernel needs AVX-512 VNNI")


@needs_kquant_int8
@pytest.mark.parametrize("case", list(SUPER_BLOCK_CASES))
def test_super_block_panels_with_int8_activations(case):
    """The int8 path on the super-blocks: within float32 rounding of the exact product of the
    quantized rows with the file's weights, within the documented tolerance (2% relative, about
    0.6% seen) of the float32 reference on gaussian rows, at 1 to 200 rows; a row's bits do not
    depend on the batch, and the decode team's tasks give the matmul's bits."""
    kinds, sizes = SUPER_BLOCK_CASES[case]
    parts = _parts(kinds, sizes, seed=len(case) + 1)
    dense = torch.cat([tc.dequantize(p.kind, p.raw) for p in parts])
    n = dense.shape[0]
    layer = KQuantLinear.from_parts(parts, n, None, kernels, int8_activations=True)
    assert layer.int8_activations and int(layer.kinds.min()) >= 2
    assert torch.equal(layer.weight, dense)  # the int8 order of Q6_K's high bits unpacks to the same codes
    exact_blob = KQuantLinear.from_parts(parts, n, None, kernels).blob
    assert layer.blob.numel() == exact_blob.numel()
    bias = torch.randn(n)
    full = layer(torch.randn(200, K, generator=torch.Generator().manual_seed(200)))
    for rows in ROWS + [8, 9, 10, 11]:
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        got = layer(x)
        reference = _quantized_rows(x) @ dense.double().t()
        torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
        exact = x @ dense.t()
        err = (got - exact).norm() / exact.norm()
        assert err < 0.02, (rows, float(err))
        layer.bias = bias
        assert torch.equal(layer(x), got + bias), rows
        layer.bias = None
        assert torch.equal(layer(x[-1:])[0], got[-1])  # a row alone: the same bits
    x = torch.randn(200, K, generator=torch.Generator().manual_seed(200))
    assert torch.equal(layer(x[7:8])[0], full[7]) and torch.equal(layer(x[:12])[11], full[11])


def _kquant_checkpoint(tmp_path, arch: str = "llama", **extra):
    cfg = tc.hf_config(arch, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, **extra)
    path = tmp_path / "kq.gguf"
    ref = tc.write_kquant_gguf(path, cfg, seed=2)
    folder = tc.write_hf_folder(tmp_path / "hf", cfg, ref)
    return cfg, path, folder


def test_q4_k_m_gguf_keeps_its_blocks_and_matches_transformers(tmp_path, caplog):
    cfg, path, folder = _kquant_checkpoint(tmp_path, max_position_embeddings=64, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})
    with caplog.at_level(logging.INFO):
        loaded = load_model(str(path), "fp32")
    assert "dequantizing" not in caplog.text  # every type here has a kernel
    layer = loaded.model.layers[0]
    modules = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
               loaded.model.lm_head)
    if kquant_matmul_supported(kernels):  # Q4_K and Q6_K: their super-blocks; Q5_K (O): 8-bit codes
        assert all(isinstance(module, KQuantLinear) for module in modules if module is not layer.self_attn.o_proj)
        assert isinstance(layer.self_attn.o_proj, QuantizedLinear)
        assert set(layer.self_attn.qkv_proj.kinds.tolist()) == {0, 1}
    else:
        assert all(isinstance(module, QuantizedLinear) for module in modules)
        assert layer.self_attn.qkv_proj.group == 16  # Q4_K + Q6_K parts: the grouped layout
        assert layer.mlp.gate_up_proj.codes.shape[2] == 8  # Q4_K: 4-bit codes
    seqs = [list(range(3, 43)), [7, 8, 9]]
    ours = loaded.model.dense_logits(seqs)
    theirs = tc.transformers_logits(tc.transformers_model(folder), seqs)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) < 1e-3
    # The float32 model on gguf's dequantized weights gives the same bits.
    dense = load_model(str(folder), "fp32").model.dense_logits(seqs)
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(ours, dense))


def test_types_without_a_kernel_are_dequantized_and_logged(tmp_path, caplog):
    cfg = tc.hf_config("qwen2", hidden_size=256, intermediate_size=256, head_dim=64)
    weights = tc.random_weights(cfg, seed=1)
    # Q3_K has no kernel here: random blocks (110 bytes per 256 weights, fp16 d last).
    q3 = np.random.default_rng(0).integers(0, 256, (256, 110), dtype=np.uint8)
    q3[:, 108:110] = np.full((256, 1), 0.001, np.float16).view(np.uint8)
    weights["model.layers.0.self_attn.q_proj.weight"] = tc.dequantize("Q3_K", q3)
    path = tc.write_gguf(tmp_path / "q3.gguf", cfg, weights, raw_blocks={"blk.0.attn_q.weight": ("Q3_K", q3)})
    with caplog.at_level(logging.INFO):
        loaded = load_model(str(path), "fp32")
    assert "dequantizing 1 Q3_K tensors to float32 at load: no matmul kernel" in caplog.text
    assert not isinstance(loaded.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    folder = tc.write_hf_folder(tmp_path / "hf", cfg, weights)
    seqs = [list(range(3, 30))]
    ours, theirs = loaded.model.dense_logits(seqs), tc.transformers_logits(tc.transformers_model(folder), seqs)
    assert float((ours[0] - theirs[0]).abs().max()) < 1e-3


@pytest.mark.skipif(kernels is None or not kernels.int8_linear_supported(), reason="int8 matmul needs AVX2")
def test_q4_k_m_gguf_in_int8_mode(tmp_path):
    """Every K-quant layer multiplies with int8 activations, stays close to the exact model,
    and the engine's batched greedy outputs equal each prompt run alone."""
    from chatloom.engine import EngineConfig, LLMEngine, SamplingParams

    _, path, _ = _kquant_checkpoint(tmp_path)
    exact = load_model(str(path), "fp32")
    fast = load_model(str(path), "fp32", int8_matmul=True)
    layer = fast.model.layers[1]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj, fast.model.lm_head):
        assert isinstance(module, (QuantizedLinear, KQuantLinear)) and module.int8_activations
    if kquant_int8_supported(kernels):
        assert isinstance(layer.mlp.down_proj, KQuantLinear)
    seq = list(range(3, 60))
    a = torch.log_softmax(exact.model.dense_logits([seq])[0].double(), -1)
    b = torch.log_softmax(fast.model.dense_logits([seq])[0].double(), -1)
    assert (a.exp() * (a - b)).sum(-1).mean().item() < 0.02
    prompts = [[5, 6, 7, 8, 9], list(range(30, 52)), [200, 3]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    batched = LLMEngine(fast, EngineConfig(num_blocks=32, block_size=4)).generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, batched):
        alone = LLMEngine(fast, EngineConfig(num_blocks=32, block_size=4)).generate([prompt], params, use_tqdm=False)[0]
        assert alone.token_ids == out.token_ids


def test_unset_int8_is_on_for_k_quant_files_only(tmp_path):
    """int8_matmul=None (the settings' default): a K-quant file multiplies with int8 activations where the
    CPU has the int8 super-block kernel (AVX-512 VNNI), or only the int8 group-layout one (AVX2 without
    AVX-512), as llama.cpp multiplies K-quants; the bundled Q4_1/Q8_0 model stays exact."""
    _, path, _ = _kquant_checkpoint(tmp_path)
    auto = load_model(str(path), "fp32", int8_matmul=None)
    down = auto.model.layers[1].mlp.down_proj
    avx2_only = kernels.int8_linear_supported() and not kquant_matmul_supported(kernels)
    assert kquant_int8_by_default(kernels) == (kquant_int8_supported(kernels) or avx2_only)
    assert down.int8_activations is kquant_int8_by_default(kernels)
    if down.int8_activations:  # in its super-blocks where their int8 kernel runs (VNNI), else the group layouts
        assert isinstance(down, KQuantLinear) is kquant_int8_supported(kernels)
    bundled = load_model(DEFAULT_MODEL, "fp32", int8_matmul=None)
    assert not bundled.model.layers[0].mlp.down_proj.int8_activations
