"""The exact head's argmax, screened with int8 activations (kernels/greedy_head.cpp).

It must pick exactly what the exact head's logits pick (torch.argmax: the first maximum, NaN
first), for 4- and 8-bit heads, rows of any scale, exact ties and near-ties, rows too flat to
screen and rows that are not finite; and the engine's greedy tokens must not change when its
decode steps use it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from chatloom.models.kernels import load_kernels
from chatloom.models.packed_linear import QuantizedLinear, QuantizedWeight, int8_matmul_supported, pack_quantized

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not int8_matmul_supported(kernels) or not hasattr(kernels, "greedy_head_argmax"),
                                reason="no int8 matmul on this CPU")


def _head(kind: str, vocab: int, hidden: int, seed: int, duplicate: dict[int, int] | None = None,
          crowd: bool = False) -> QuantizedLinear:
    """An exact (float activations) quantized head with random blocks; `duplicate` copies weight
    row src to row dst, so that their logits tie exactly; `crowd` makes every row row 0 with three
    codes moved by one step, so that their logits crowd together."""
    rng = np.random.default_rng(seed)
    nb = hidden // 32
    scale = lambda: rng.uniform(-0.05, 0.05, (vocab, nb, 1)).astype(np.float16).view(np.uint8)  # noqa: E731
    if kind == "Q4_1":
        blocks = [scale(), scale(), rng.integers(0, 256, (vocab, nb, 16), dtype=np.uint8)]
    else:
        blocks = [scale(), rng.integers(-128, 128, (vocab, nb, 32), dtype=np.int8).view(np.uint8)]
    raw = np.concatenate(blocks, -1).reshape(vocab, -1)
    for dst, src in (duplicate or {}).items():
        raw[dst] = raw[src]
    if crowd:
        block, first_code = (20, 4) if kind == "Q4_1" else (34, 2)  # bytes per block; codes after the scales
        raw[1:] = raw[0]
        for row in range(1, vocab):
            for at in rng.integers(0, nb * (block - first_code), 3):
                raw[row, (at // (block - first_code)) * block + first_code + at % (block - first_code)] ^= 1
    codes, scales = pack_quantized([QuantizedWeight(kind, raw, vocab, hidden)])
    return QuantizedLinear(codes, scales, vocab, None, kernels)


# The AVX-512 path where this CPU has it, and the plain loops everywhere.
PATHS = ["avx512", "scalar"]


def _has_avx512() -> bool:
    head = _head("Q8_0", 16, 32, seed=0)
    try:
        _screened(head, torch.ones(1, 32), "avx512")
    except RuntimeError as e:
        assert "not available on this CPU" in str(e)
        return False
    return True


def _require(isa: str) -> None:
    if isa == "avx512" and not _has_avx512():
        pytest.skip("this CPU has no AVX-512")


def _screened(head: QuantizedLinear, x: torch.Tensor, isa: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    codes8, scales8, norms = head.greedy_screen()
    return kernels.greedy_head_argmax(x, head.codes, head.scales, head.out_features, codes8, scales8, norms, isa)


def _exact(head: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    return kernels.quantized_linear(x, head.codes, head.scales, head.out_features, None, "auto")


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 13, 40])
def test_the_screened_argmax_is_the_exact_heads(kind, rows, isa):
    _require(isa)
    head = _head(kind, 1000, 128, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    # Rows of very different scales, and one with an outlier that widens its bound.
    x = torch.randn(rows, 128, generator=gen) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[0, 5] = 500.0
    logits = _exact(head, x)
    argmax, picked = _screened(head, x, isa)
    assert torch.equal(argmax, logits.argmax(1))
    assert torch.equal(picked, logits.gather(1, argmax.unsqueeze(1)).squeeze(1))  # the exact logit's bits


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_crowds_of_candidates_over_many_panels_are_decided_exactly(kind, isa):
    # Every weight row is one shared row plus small noise, and the queries point along the shared
    # row: the logits crowd within the screen's bound, so dozens to hundreds of features in many panels
    # (the last one partial) must be recomputed exactly, and the pick must still be the exact head's.
    _require(isa)
    vocab, hidden = 1000, 128
    head = _head(kind, vocab, hidden, seed=11, crowd=True)
    base = head.weight[0]
    gen = torch.Generator().manual_seed(12)
    x = (base / base.norm() * 30).repeat(6, 1) + 0.05 * torch.randn(6, hidden, generator=gen)
    x[5] *= -1
    logits = _exact(head, x)
    # About the candidates the kernel sees: estimates whose bound (the rounding error of x to int8 per
    # block of 32, times the weight row's norm) reaches the exact maximum.
    codes8, scales8, norms = head.greedy_screen()
    approx = kernels.int8_linear(x, codes8, scales8, vocab, None, "auto")
    blocks = x.reshape(6, -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    error = (blocks - torch.round(blocks / step) * step).reshape(6, -1).norm(dim=1, keepdim=True)
    crowded = approx + error * norms >= logits.max(1, keepdim=True).values
    assert int(crowded.sum(1).min()) > 50 and len({int(j) // 16 for j in crowded.nonzero()[:, 1]}) > 20
    argmax, picked = _screened(head, x, isa)
    assert torch.equal(argmax, logits.argmax(1))
    assert torch.equal(picked, logits.gather(1, argmax.unsqueeze(1)).squeeze(1))


def test_both_paths_pick_the_same_bits_and_unknown_paths_are_named():
    head = _head("Q8_0", 700, 64, seed=13)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(14)) * 4
    got = [_screened(head, x, isa) for isa in PATHS if isa == "scalar" or _has_avx512()]
    for argmax, picked in got[1:]:
        assert torch.equal(argmax, got[0][0]) and torch.equal(picked, got[0][1])
    with pytest.raises(RuntimeError, match="unknown instruction set 'sse9' for the greedy head"):
        _screened(head, x, "sse9")


def test_norms_bound_every_weight_row():
    head = _head("Q4_1", 300, 64, seed=1)
    _, _, norms = head.greedy_screen()
    exact = head.weight.double().norm(dim=1)
    assert bool((norms.double() >= exact).all()) and bool((norms.double() <= exact * (1 + 1e-5) + 1e-30).all())


def test_exact_ties_go_to_the_first_index_and_near_ties_are_decided_exactly():
    # Rows 700 and 701 copy rows 3 and 4: equal logits, so the first of each pair must win whatever
    # the screen estimates. Queries built to favour them put the tie at the top.
    head = _head("Q8_0", 1000, 128, seed=7, duplicate={700: 3, 701: 4})
    w = head.weight
    x = torch.stack([w[3], w[4], w[3] + w[4], w[3] * 1e-3]).contiguous()
    logits = _exact(head, x)
    argmax, _ = _screened(head, x)
    assert torch.equal(argmax, logits.argmax(1))
    assert argmax[0].item() in (3, logits[0].argmax().item()) and argmax[0].item() != 700
    # Near-ties: many random queries projected onto the difference of two rows' weights, so their
    # top two logits differ by less than the screen's bound; the exact recompute must decide.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(64, 128, generator=gen)
    d = (w[10] - w[11]) / (w[10] - w[11]).norm()
    q = q - (q @ d).unsqueeze(1) * d + 20 * w[10] / w[10].norm()
    logits = _exact(head, q)
    assert torch.equal(_screened(head, q)[0], logits.argmax(1))


def test_rows_too_flat_or_not_finite_are_recomputed_whole():
    head = _head("Q4_1", 5000, 64, seed=2)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    x[1] = 0.0  # every logit the same: far more candidates than screening is worth
    x[2, 7] = float("nan")
    x[3, 9] = float("inf")
    logits = _exact(head, x)
    argmax, picked = _screened(head, x)
    assert torch.equal(argmax, logits.argmax(1))
    assert argmax[1].item() == 0 and bool(torch.isnan(picked[2]))


def test_heads_it_cannot_screen_say_so():
    head = _head("Q8_0", 64, 64, seed=4)
    codes, scales = pack_quantized([QuantizedWeight("Q8_0", np.zeros((64, 68), np.uint8), 64, 64)])
    assert QuantizedLinear(codes, scales, 64, None, kernels, int8_activations=True).greedy_screen() is None
    assert QuantizedLinear(codes, scales, 64, torch.zeros(64), kernels).greedy_screen() is None
    assert head.greedy_screen() is not None


def test_the_engine_gives_the_same_greedy_tokens_with_screened_steps(smollm2):
    # Sixteen sequences: wider than the decode team, so the stack's head is screened.
    from chatloom.engine import EngineConfig, LLMEngine, SamplingParams

    stack = smollm2.model.decode_stack()
    if stack is None or not stack.has_greedy_head:
        pytest.skip("this model's decode stack has no screened head here")
    prompts = [f"Question {i}: what is {i} times {i + 3}?" for i in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = []
    for screened in (True, False):
        engine = LLMEngine(smollm2, EngineConfig(num_blocks=256, max_num_seqs=16))
        engine.runner.argmax_only_steps = screened
        calls = []
        real = engine.runner.model.decode_tokens
        engine.runner.model.decode_tokens = lambda *a, **k: calls.append(a[-1]) or real(*a, **k)
        runs.append([o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)])
        engine.runner.model.decode_tokens = real
        assert any(calls) == screened
    assert runs[0] == runs[1]
