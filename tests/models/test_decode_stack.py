"""The decode step's decoder stack in one native call (kernels/decode_stack.cpp, decode_team.cpp).

It must give the bits of the layer-by-layer module path for every kind of matmul layer a model can
have (float32 panels, bfloat16, GGUF 4/8-bit and K-quants, with float or int8 activations), for a
batch mixing sequence lengths and proposed tokens, in the logits and in the KV pool it writes; and
models it cannot run must keep the module path.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import chatloom.models.llama as llama
from chatloom.engine.model_runner import ModelRunner
from chatloom.engine.sampling_params import SamplingParams
from chatloom.engine.scheduler import ScheduledBatch
from chatloom.engine.sequence import Sequence
from chatloom.models.config import ModelConfig
from chatloom.models.kernels import load_kernels
from chatloom.models.packed_linear import (KQuantLinear, QuantizedWeight, bf16_matmul_supported, int8_matmul_supported,
                                           kquant_int8_supported, kquant_matmul_supported, pack_linears)
from chatloom.models.registry import tiny_random_config

import tiny_checkpoints as tc

kernels = load_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "DecodeStack"),
                                reason="C++ kernels unavailable")

# K-quants need 256 input features per super-block.
CONFIG = ModelConfig(architecture="llama", vocab_size=300, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, max_position=512, rope_theta=10000.0,
                     name="stack-test")

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _model(cfg: ModelConfig = CONFIG) -> llama.DecoderForCausalLM:
    model = llama.DecoderForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return model


def _quantized(model: llama.DecoderForCausalLM, kinds: list[str]) -> dict[str, list[QuantizedWeight]]:
    """Every decoder matmul as GGUF blocks: one part per kind in `kinds`, rows split between them
    (two different kinds make a fused layer of the grouped layout)."""
    out, seed = {}, 0
    for i, layer in enumerate(model.layers):
        for name in LINEARS:
            lin = layer.get_submodule(name)
            n, k = lin.out_features, lin.in_features
            sizes = [n // len(kinds)] * (len(kinds) - 1)
            sizes.append(n - sum(sizes))
            parts = []
            for kind, rows in zip(kinds, sizes):
                seed += 1
                raw = tc.random_kquant_blocks(kind, rows, k, seed) if kind.endswith("_K") else tc.random_blocks(kind, rows, k, seed, 0.02)
                parts.append(QuantizedWeight(kind, raw, rows, k))
            out[f"layers.{i}.{name}"] = parts
    return out


def _batch() -> ScheduledBatch:
    """Three decoding sequences of different lengths, one carrying two proposed tokens."""
    seqs = []
    for i, (ctx, table) in enumerate([(5, [3, 7]), (13, [0, 9, 4, 11]), (1, [20])]):
        seq = Sequence(f"s{i}", list(range(10 + i, 11 + i + ctx)), SamplingParams(max_tokens=8))
        seq.num_computed_tokens = ctx
        seq.block_table = table
        seqs.append(seq)
    seqs[1].spec_token_ids = [5, 6]
    return ScheduledBatch(decodes=seqs)


def _runner(model: llama.DecoderForCausalLM, kv_dtype: torch.dtype | None = None
            ) -> tuple[ModelRunner, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A runner whose pool holds random K/V (whatever earlier steps left), and a copy of that pool."""
    runner = ModelRunner(model, num_blocks=32, block_size=4, kv_cache_dtype=kv_dtype)
    gen = torch.Generator().manual_seed(3)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return runner, _pool(runner)


def _pool(runner: ModelRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in runner.kv_caches]


def _restore(runner: ModelRunner, pool: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for (k, v), (k0, v0) in zip(runner.kv_caches, pool):
        k.copy_(k0)
        v.copy_(v0)


def _same_pool(runner: ModelRunner, pool: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(runner.kv_caches, pool))


def _wide_batch() -> ScheduledBatch:
    """Seven decoding sequences with a proposed token each: 14 queries, more than the team path takes."""
    seqs = []
    for i in range(7):
        seq = Sequence(f"w{i}", list(range(10 + i, 14 + 2 * i)), SamplingParams(max_tokens=8))
        seq.num_computed_tokens = len(seq.token_ids) - 1
        seq.block_table = [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3]
        seq.spec_token_ids = [7 + i]
        seqs.append(seq)
    return ScheduledBatch(decodes=seqs)


def _plain_batch() -> ScheduledBatch:
    """Five decoding sequences of different lengths, none with proposed tokens."""
    seqs = []
    for i, (ctx, table) in enumerate([(5, [3, 7]), (13, [0, 9, 4, 11]), (1, [20]), (8, [12, 13, 14]), (3, [21])]):
        seq = Sequence(f"p{i}", list(range(10 + i, 11 + i + ctx)), SamplingParams(max_tokens=8))
        seq.num_computed_tokens = ctx
        seq.block_table = table
        seqs.append(seq)
    return ScheduledBatch(decodes=seqs)


def _wide_plain_batch() -> ScheduledBatch:
    """Fourteen plain decodes: more queries than the team path takes."""
    seqs = []
    for i in range(14):
        seq = Sequence(f"q{i}", list(range(10 + i, 13 + i + i % 3)), SamplingParams(max_tokens=8))
        seq.num_computed_tokens = len(seq.token_ids) - 1
        seq.block_table = [2 * i, 2 * i + 1]
        seqs.append(seq)
    return ScheduledBatch(decodes=seqs)


def _both_paths(model: llama.DecoderForCausalLM, monkeypatch, batch=_batch, kv_dtype=None) -> None:
    """One decode step through the stack and through the modules, from the same pool: same bits."""
    runner, start = _runner(model, kv_dtype)
    python_calls = []
    real = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a: python_calls.append(1) or real(*a))

    native_logits = runner.execute(batch()).logits
    assert model.decode_stack() is not None and not python_calls  # the stack ran, not the modules
    native_pool = _pool(runner)
    _restore(runner, start)
    model.native_decode = False
    module_logits = runner.execute(batch()).logits
    assert len(python_calls) == len(model.layers)
    assert torch.equal(native_logits, module_logits)
    assert _same_pool(runner, native_pool)


def test_decode_attention_in_one_call_gives_the_step_by_step_bits(monkeypatch):
    """Layer by layer, a decode step's rotary, pool writes and attention are one native call
    (decode_attention) instead of a dozen tensor operations: the same logits and pool, bit for bit."""
    from chatloom.models.attention import AttentionBatch

    model = _model(tiny_random_config())
    assert pack_linears(model)
    model.native_decode = False
    runner, start = _runner(model)
    fused_calls, plain_calls = [], []
    real = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a: fused_calls.append(1) or real(*a))
    fused_logits = runner.execute(_batch()).logits
    assert len(fused_calls) == len(model.layers)
    fused_pool = _pool(runner)
    _restore(runner, start)
    monkeypatch.setattr(AttentionBatch, "decode_only", property(lambda self: plain_calls.append(1) and False))
    plain_logits = runner.execute(_batch()).logits
    assert plain_calls and len(fused_calls) == len(model.layers)  # the step-by-step path ran this time
    assert torch.equal(fused_logits, plain_logits)
    assert _same_pool(runner, fused_pool)


def test_float32_panels(monkeypatch):
    model = _model()
    assert pack_linears(model)
    _both_paths(model, monkeypatch)


@pytest.mark.skipif(not bf16_matmul_supported(kernels), reason="no bf16 matmul")
def test_bfloat16_weights(monkeypatch):
    model = _model()
    assert pack_linears(model, bf16_weights=True)
    _both_paths(model, monkeypatch)


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("kinds", [["Q4_1"], ["Q8_0"], ["Q4_0"], ["Q4_K"], ["Q5_K"], ["Q6_K"], ["Q4_1", "Q8_0"]],
                         ids=lambda k: "+".join(k))
def test_gguf_quantized_weights(kinds, int8, monkeypatch):
    if int8 and not int8_matmul_supported(kernels):
        pytest.skip("no int8 matmul on this CPU")
    model = _model()
    assert pack_linears(model, _quantized(model, kinds), int8_activations=int8)
    _both_paths(model, monkeypatch)


@pytest.mark.skipif("avx512" not in (kernels.float_linear_isas() if kernels else []), reason="no AVX-512 path")
@pytest.mark.parametrize("kinds", [["Q4_1"], ["Q8_0"], ["Q4_K"]], ids=lambda k: "+".join(k))
def test_exact_quantized_models_step_on_one_team_of_threads(kinds, monkeypatch):
    """Every matmul quantized with float activations (the default, exact mode): decode steps of up to 12
    queries run on one team of threads (decode_team.cpp), with the module path's bits whether profiled
    or not; wider batches take the call-by-call stack, also with the same bits."""
    model = _model()
    assert pack_linears(model, _quantized(model, kinds))
    stack = model.decode_stack()
    assert stack.team_path
    stack.set_profiling(True)
    _both_paths(model, monkeypatch)
    parts = stack.profile()
    assert parts.pop("steps") == 1
    assert parts.pop("redone") >= 0  # items run again because a thread was stopped holding them
    assert set(parts) == {"input_norm", "qkv", "attention", "o", "post_norm", "gate_up", "silu", "down", "head"}
    assert all(v >= 0 for v in parts.values()) and parts["gate_up"] > 0
    assert parts["head"] == 0 and not stack.has_head  # a float32 head stays a module of its own
    model.native_decode = True
    _both_paths(model, monkeypatch, _wide_batch)
    assert stack.profile()["steps"] == 1  # the 14-query step did not run on the team


@pytest.mark.skipif("avx512" not in (kernels.float_linear_isas() if kernels else []), reason="no AVX-512 path")
def test_a_thread_stopped_holding_an_item_does_not_hold_up_the_step(monkeypatch):
    """When the OS stops a thread of the team in the middle of an item (here the second thread sleeps
    2 ms before every item it takes), the other runs that item again and carries the step on; the
    sleeper finishes its items late, from inputs the team has moved past, into buffers nobody reads
    any more: the step keeps the module path's bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of two, even on a machine with one core
    try:
        model = _model()
        assert pack_linears(model, _quantized(model, ["Q4_1"]))
        stack = model.decode_stack()
        stack.set_profiling(True)
        stack.set_test_stall(2_000_000, 1)
        # The sleeper may find every item taken before it asks, in a whole step (on a loaded machine the
        # OS may not run it at all for a while): step until an item was redone.
        deadline = time.monotonic() + 60
        while True:
            _both_paths(model, monkeypatch)
            model.native_decode = True
            if stack.profile()["redone"] > 0 or time.monotonic() > deadline:
                break
        assert stack.profile()["redone"] > 0
    finally:
        torch.set_num_threads(threads)


def _with_quantized_head(model: llama.DecoderForCausalLM, kinds: list[str], head_kind: str
                         ) -> dict[str, list[QuantizedWeight]]:
    quantized = _quantized(model, kinds)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size  # 300: the last task is partial
    quantized["lm_head"] = [QuantizedWeight(head_kind, tc.random_blocks(head_kind, vocab, hidden, 99, 0.02), vocab,
                                            hidden)]
    return quantized


def _both_heads(model: llama.DecoderForCausalLM, batch=_batch, kv_dtype: torch.dtype | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step with the head in the stack's call and one through the modules, from the
    same pool: the same logits and KV pool, bit for bit, and the argmax of torch.argmax."""
    runner, start = _runner(model, kv_dtype)
    native = runner.execute(batch())
    logits, argmax = native.logits, native.argmax
    native_pool = _pool(runner)
    _restore(runner, start)
    model.native_decode = False
    module = runner.execute(batch())
    module_logits, module_argmax = module.logits, module.argmax
    model.native_decode = True
    assert module.picks is None
    assert logits.shape == (len(module_argmax), model.config.vocab_size)
    assert torch.equal(logits.view(torch.int32), module_logits.view(torch.int32))  # bits, NaNs too
    assert torch.equal(argmax, module_argmax) and torch.equal(argmax, logits.argmax(dim=-1))
    assert _same_pool(runner, native_pool)
    # A plain decode step (no proposed tokens) runs from the engine's lists, with the argmax as ints.
    plain = not any(s.spec_token_ids for s in batch().decodes)
    assert (native.picks is not None) == plain
    if plain:
        assert native.picks.tokens == argmax.tolist()
        assert native.picks.nan_rows == [r for r in range(len(argmax)) if torch.isnan(logits[r]).any()]
    return logits, argmax


@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_16_bit_pool_steps_on_the_team_with_the_modules_bits(kv_dtype, int8, monkeypatch):
    """With a 16-bit pool (the int8 mode's default) a few queries still step on the team: its keys and
    values are rounded into the pool as decode_attention rounds them, and the logits and the stored
    K/V are the modules', bit for bit; wider steps run layer by layer, with the same bits."""
    if int8 and not int8_matmul_supported(kernels):
        pytest.skip("no int8 matmul on this CPU")
    model = _model()
    assert pack_linears(model, _quantized(model, ["Q4_1"]), int8_activations=int8)
    stack = model.decode_stack()
    stack.set_profiling(True)
    for batch in (_batch, _plain_batch, _wide_plain_batch):
        model.native_decode = True  # _both_paths ends on the module path
        _both_paths(model, monkeypatch, batch=batch, kv_dtype=kv_dtype)
    # The int8 kinds of this layout keep the call-by-call stack, as does every kind of it without the
    # AVX-512 path (its tasks are AVX-512 kernels); 14 queries run layer by layer.
    team = not int8 and "avx512" in kernels.float_linear_isas()
    assert stack.profile()["steps"] == (2 if team else 0)


@pytest.mark.skipif("avx512" not in (kernels.float_linear_isas() if kernels else []), reason="no AVX-512 path")
@pytest.mark.parametrize("head_kind", ["Q8_0", "Q4_1"])
def test_a_quantized_head_runs_as_the_teams_last_phase(head_kind):
    """A quantized head joins the stack's call (decode_logits): its tasks are the team's last phase
    and find their columns' best logit as they finish. Logits, argmax and pool are those of the
    module path, on the team (up to 12 queries) and on the wider call-by-call path."""
    model = _model()
    assert pack_linears(model, _with_quantized_head(model, ["Q4_1"], head_kind))
    stack = model.decode_stack()
    assert stack.team_path and stack.has_head
    stack.set_profiling(True)
    _both_heads(model)
    assert stack.profile()["head"] > 0 and stack.profile()["steps"] == 1
    _both_heads(model, _wide_batch)
    assert stack.profile()["steps"] == 1  # 14 queries: forward, then the head's kernel


@pytest.mark.skipif("avx512" not in (kernels.float_linear_isas() if kernels else []), reason="no AVX-512 path")
@pytest.mark.parametrize("head_kind", ["Q8_0", "Q4_1"])
def test_a_plain_decode_step_runs_from_the_engines_lists(head_kind, monkeypatch):
    """Without proposed tokens, a decode step is one call on Python ints (decode_tokens): the stack
    embeds the ids itself, and no tensor is made on the way. Same logits, argmax and pool as the
    module path, on the team and on the wider path; the argmax also comes back as ints."""
    model = _model()
    assert pack_linears(model, _with_quantized_head(model, ["Q4_1"], head_kind))
    assert model.decode_stack().has_embedding and model.decodes_tokens()
    runner, _ = _runner(model)
    made = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(1) or real_tensor(*a, **k))
    assert runner.execute(_plain_batch()).picks is not None and not made
    monkeypatch.undo()
    _both_heads(model, _plain_batch)
    _both_heads(model, _wide_plain_batch)
    model.lm_head.scales[5, 0, 0, 2] = float("nan")  # feature 82: every row's maximum is a NaN
    logits, argmax = _both_heads(model, _plain_batch)
    assert argmax.tolist() == [82] * 5


def _greedy(batch: ScheduledBatch) -> ScheduledBatch:
    for seq in batch.decodes:
        seq.params = SamplingParams(max_tokens=8, temperature=0)
    return batch


@pytest.mark.skipif("avx512" not in (kernels.float_linear_isas() if kernels else []), reason="no AVX-512 path")
@pytest.mark.parametrize("head_kind", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("wide", [False, True], ids=["team", "wide"])
def test_a_step_checking_greedy_proposals_finds_each_rows_argmax_alone(head_kind, wide):
    """Every row greedy and some carrying proposed tokens: the runner asks the stack for each row's
    argmax alone (decode_argmax). Wider than the team the head is screened and no logits come back;
    on the team they do. Either way the argmax is the logits', the pool the same, and rows whose
    maximum is a NaN are named."""
    model = _model()
    assert pack_linears(model, _with_quantized_head(model, ["Q4_1"], head_kind))
    assert model.decode_stack().has_greedy_head
    batch = _wide_batch if wide else _batch
    runner, start = _runner(model)
    runner.argmax_only_steps = False
    full = runner.execute(_greedy(batch()))
    assert full.picks is None and full.logits.shape[1] == model.config.vocab_size
    full_pool = _pool(runner)
    for broken in (False, True):
        if broken:
            with torch.no_grad():
                model.norm.weight[3] = float("nan")  # every hidden state, so every logit, is a NaN
            runner.argmax_only_steps = False
            _restore(runner, start)
            full = runner.execute(_greedy(batch()))
        _restore(runner, start)
        runner.argmax_only_steps = True
        alone = runner.execute(_greedy(batch()))
        assert alone.logits.shape[1] == (0 if wide else model.config.vocab_size)
        assert torch.equal(alone.argmax, full.argmax)
        assert alone.picks.tokens == full.argmax.tolist()
        assert alone.picks.nan_rows == (list(range(len(full.argmax))) if broken else [])
        if not broken:
            assert _same_pool(runner, full_pool)
    assert alone.picks.tokens == [0] * len(full.argmax)  # the first NaN


@pytest.mark.skipif("avx512" not in (kernels.float_linear_isas() if kernels else []), reason="no AVX-512 path")
def test_a_token_id_outside_the_vocabulary_fails_before_anything_is_written():
    model = _model()
    assert pack_linears(model, _with_quantized_head(model, ["Q4_1"], "Q8_0"))
    runner, start = _runner(model)
    batch = _plain_batch()
    seq = batch.decodes[1]
    seq.token_ids[seq.num_computed_tokens] = model.config.vocab_size  # one past the last id
    with pytest.raises(RuntimeError, match="token id 300 is outside the vocabulary"):
        runner.execute(batch)
    assert _same_pool(runner, start)


def test_a_runner_without_kernels_keeps_the_module_path():
    model = _model()
    assert pack_linears(model, _with_quantized_head(model, ["Q4_1"], "Q8_0"))
    runner = ModelRunner(model, num_blocks=32, block_size=4, use_kernels=False)
    assert runner.execute(_plain_batch()).picks is None


@pytest.mark.skipif("avx512" not in (kernels.float_linear_isas() if kernels else []), reason="no AVX-512 path")
def test_the_fused_argmax_ranks_like_torch_argmax():
    """Equal logits: the first wins. A NaN ranks above every number, and the first NaN wins."""
    model = _model()
    assert pack_linears(model, _with_quantized_head(model, ["Q4_1"], "Q8_0"))
    scales = model.lm_head.scales  # [panels, K / 32, 2, 16]: d, then m
    scales.zero_()  # every logit 0.0
    _, argmax = _both_heads(model)
    assert argmax.tolist() == [0, 0, 0, 0, 0]
    scales[13, 0, 0, 3] = float("nan")  # feature 13 * 16 + 3 = 211, in the fourth task
    scales[17, 0, 0, 0] = float("nan")  # 272, a later NaN
    scales[2, 0, 0, 5] = 1000.0  # a large number does not beat a NaN
    logits, argmax = _both_heads(model)
    assert argmax.tolist() == [211] * 5 and torch.isnan(logits[:, 272]).all()


@pytest.mark.skipif(not kquant_matmul_supported(kernels), reason="the super-block K-quant kernel needs AVX-512")
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("kv_dtype", [None, torch.float16], ids=["model-kv", "fp16-kv"])
def test_a_q4_k_m_model_steps_on_the_team_with_its_q6_k_head(int8, kv_dtype):
    """Fused Q4_K + Q6_K layers and a Q6_K head, kept in their super-blocks (exact, or with int8
    activations, whose default pool is float16): decode steps of up to 12 queries run on the team
    with the head as its last phase, wider ones call by call, all with the module path's bits."""
    if int8 and not kquant_int8_supported(kernels):
        pytest.skip("the int8 super-block kernel needs AVX-512 VNNI")
    model = _model()
    quantized = _quantized(model, ["Q4_K", "Q6_K"])
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    quantized["lm_head"] = [QuantizedWeight("Q6_K", tc.random_kquant_blocks("Q6_K", vocab, hidden, 99), vocab, hidden)]
    assert pack_linears(model, quantized, int8_activations=int8)
    layer = model.layers[0]
    assert all(isinstance(layer.get_submodule(name), KQuantLinear) for name in LINEARS)
    assert layer.mlp.down_proj.int8_activations == int8 and model.lm_head.int8_activations == int8
    assert isinstance(model.lm_head, KQuantLinear)
    stack = model.decode_stack()
    assert stack.team_path and stack.has_head
    stack.set_profiling(True)
    _both_heads(model, kv_dtype=kv_dtype)
    _both_heads(model, _plain_batch, kv_dtype)
    assert stack.profile()["head"] > 0 and stack.profile()["steps"] == 2
    _both_heads(model, _wide_batch, kv_dtype)
    assert stack.profile()["steps"] == 2  # 14 queries: forward, then the head's kernel


def test_int8_and_grouped_models_keep_the_call_by_call_stack():
    model = _model()
    assert pack_linears(model, _quantized(model, ["Q4_1", "Q8_0"]))  # fused parts of two kinds: grouped layout
    assert not model.decode_stack().team_path
    if int8_matmul_supported(kernels):
        model = _model()
        assert pack_linears(model, _quantized(model, ["Q4_1"]), int8_activations=True)
        assert not model.decode_stack().team_path


@pytest.mark.parametrize("change", [{"qk_norm": True}, {"sandwich_norms": True}, {"embedding_scale": 2.0}])
def test_models_the_stack_cannot_run_keep_the_module_path(change):
    cfg = dataclasses.replace(tiny_random_config(), **change)
    model = _model(cfg)
    assert pack_linears(model)
    assert model.decode_stack() is None


def test_unpacked_model_has_no_stack():
    model = _model(tiny_random_config())  # nn.Linear layers: no kernel layers to hand over
    assert model.decode_stack() is None


@pytest.mark.skipif("avx512" not in (kernels.float_linear_isas() if kernels else []), reason="no AVX-512 path")
def test_the_engine_gives_the_same_greedy_tokens_from_the_lists_path(tiny_model_fp32, monkeypatch):
    """LLMEngine end to end on an exact quantized model with its head in the stack: decode steps go
    through decode_tokens and the sampler's picks, and every request (min_tokens and a seeded sampled
    one included) gets the tokens the module path gives."""
    from chatloom.engine.config import EngineConfig
    from chatloom.engine.llm_engine import LLMEngine
    from chatloom.models.loader import LoadedModel

    cfg = dataclasses.replace(CONFIG, vocab_size=tiny_model_fp32.config.vocab_size)  # every id decodes
    model = _model(cfg)
    assert pack_linears(model, _with_quantized_head(model, ["Q4_1"], "Q8_0"))
    loaded = LoadedModel("stack-test", model, tiny_model_fp32.tokenizer, cfg)
    calls = []
    real = model.decode_tokens
    monkeypatch.setattr(model, "decode_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [[5, 17, 42, 9], [100, 3], [7] * 11]
    params = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0, min_tokens=5),
              SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)]

    def run(native: bool) -> list[list[int]]:
        model.native_decode = native
        engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=4, enable_prefix_caching=False))
        return [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]

    lists_path = run(True)
    assert calls
    assert lists_path == run(False)
