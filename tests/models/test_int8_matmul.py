"""The int8-activation matmul for 4-bit GGUF weights (kernels/int8_gemm.cpp)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from chatloom.models import load_model
from chatloom.models.kernels import load_kernels
from chatloom.models.packed_linear import (QuantizedLinear, QuantizedWeight, from_int8_layout, pack_linears,
                                           pack_quantized, to_int8_layout, uses_int8_matmul)

kernels = load_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.int8_linear_supported(),
                                reason="int8 matmul kernel unavailable on this CPU")


def _layer(kind: str, rows: int, cols: int, seed: int) -> tuple[QuantizedLinear, torch.Tensor]:
    """A Q4_1 or Q8_0 int8-activation layer with random codes and scales, and its exactly
    dequantized weight."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    nb = cols // 32
    scale = lambda: rng.uniform(-0.05, 0.05, (rows, nb, 1)).astype(np.float16).view(np.uint8)  # noqa: E731
    if kind == "Q4_1":
        blocks = [scale(), scale(), rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)]
    else:  # Q8_0, with the full int8 range (-128 included) to test the sign trick's edges
        blocks = [scale(), rng.integers(-128, 128, (rows, nb, 32), dtype=np.int8).view(np.uint8)]
    part = QuantizedWeight(kind, np.concatenate(blocks, -1).reshape(rows, -1), rows, cols)
    dense = torch.from_numpy(quants.dequantize(part.raw, GGMLQuantizationType[kind]).astype(np.float32))
    codes, scales = pack_quantized([part])
    return QuantizedLinear(codes, scales, rows, None, kernels, int8_activations=True), dense


def _int8_reference(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Each row quantized per block of 32 (d = max|x| / 127, q = round(x / d)), then the
    exact product in float64."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)
    return (q.double() * d.double()).view_as(x) @ dense.double().t()


@pytest.mark.parametrize("kind,width", [("Q4_1", 32), ("Q8_0", 64)])
def test_layout_roundtrip_and_weight(kind, width):
    layer, dense = _layer(kind, 40, 96, 0)
    assert layer.codes.shape == (3, 24, width)
    assert torch.equal(to_int8_layout(from_int8_layout(layer.codes)), layer.codes)
    assert torch.equal(layer.weight, dense)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 97, 200])
def test_int8_linear_matches_the_integer_reference(kind, rows):
    layer, dense = _layer(kind, 37, 128, rows)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(37)
    ref = _int8_reference(x, dense)
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-4)
    got = kernels.int8_linear(x, layer.codes, layer.scales, 37, bias)
    torch.testing.assert_close(got.double(), ref + bias.double(), rtol=1e-5, atol=1e-4)
    # Rounding the activations to 8 bits costs little against the exact product.
    exact = x.double() @ dense.double().t()
    assert (layer(x).double() - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_int8_rows_do_not_depend_on_the_batch(kind):
    """Whatever the batch, a row gets the bits it gets alone: from 12 rows the VNNI path splits them
    into tiles of at most 6 of near-equal size (13 as 5 + 4 + 4, 32 as 6 + 6 + 5 + 5 + 5 + 5), in
    blocks of 96 rows (97: a block, then one row alone)."""
    layer, _ = _layer(kind, 50, 256, 7)
    x = torch.randn(97, 256, generator=torch.Generator().manual_seed(1))
    alone = [layer(x[i:i + 1])[0] for i in range(len(x))]
    for i in (0, 1, 2, 3, 20, 40):
        assert torch.equal(layer(x[i:i + 5])[0], alone[i])
    for rows in (12, 13, 25, 32, 41, 97):
        full = layer(x[:rows])
        for i in range(rows):
            assert torch.equal(full[i], alone[i]), (rows, i)


def test_q4_0_layers_use_the_int8_kernel_with_the_same_weights():
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(5)
    scale = rng.uniform(-0.05, 0.05, (24, 3, 1)).astype(np.float16).view(np.uint8)
    raw = np.concatenate([scale, rng.integers(0, 256, (24, 3, 16), dtype=np.uint8)], -1).reshape(24, -1)
    part = QuantizedWeight("Q4_0", raw, 24, 96)
    dense = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_0).astype(np.float32))
    model = torch.nn.ModuleDict({"fast": torch.nn.Linear(96, 24, bias=False)})
    assert pack_linears(model, {"fast": [part]}, int8_activations=True)
    fast = model["fast"]
    assert fast.int8_activations and torch.equal(fast.weight, dense)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(fast(x).double(), _int8_reference(x, dense), rtol=1e-5, atol=1e-4)


def test_zero_rows_and_bad_shapes():
    layer, _ = _layer("Q4_1", 16, 64, 2)
    assert torch.equal(layer(torch.zeros(2, 64)), torch.zeros(2, 16))
    with pytest.raises(RuntimeError, match="inner dimensions differ"):
        kernels.int8_linear(torch.randn(2, 96), layer.codes, layer.scales, 16)


def test_bundled_model_with_int8_matmul(smollm2):
    """Opt-in: the 4-bit layers and the Q8_0 head switch; the logits stay close to the exact
    model's and a row's tokens still do not depend on the batch."""
    fast = load_model("smollm2-135m-instruct", "fp32", int8_matmul=True)
    assert uses_int8_matmul(fast.model) and not uses_int8_matmul(smollm2.model)
    assert fast.model.layers[0].mlp.gate_up_proj.int8_activations
    assert fast.model.lm_head.int8_activations and fast.model.lm_head.codes.shape[2] == 64
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    exact = torch.log_softmax(smollm2.model.dense_logits([ids])[0].double(), -1)
    approx = torch.log_softmax(fast.model.dense_logits([ids])[0].double(), -1)
    kl = (exact.exp() * (exact - approx)).sum(-1).mean().item()
    assert kl < 0.02
    assert (exact.argmax(-1) == approx.argmax(-1)).double().mean() > 0.9

    from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
    prompts = [smollm2.tokenizer.encode(t) for t in ("Once upon a time", "The capital of Italy is", "1, 2, 3,")]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = LLMEngine(fast, EngineConfig(num_blocks=64)).generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, batched):
        alone = LLMEngine(fast, EngineConfig(num_blocks=64)).generate([prompt], params, use_tqdm=False)[0]
        assert alone.token_ids == out.token_ids
