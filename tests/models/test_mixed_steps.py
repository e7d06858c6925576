"""A step with a few prompt tokens beside decodes: its chunks run as decode queries, so the native decode
stack takes the whole step, with the bits and the pool of the general path; a step of more queries, or
a runner with the switch off, takes the general path as before."""
from __future__ import annotations

import random

import pytest
import torch

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.scheduler import MIXED_AS_DECODE_QUERIES, ScheduledBatch
from chatloom.engine.sequence import Sequence
from chatloom.models.packed_linear import int8_matmul_supported, pack_linears

from test_decode_stack import _model, _plain_batch, _pool, _quantized, _restore, _runner, _same_pool, kernels

pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "DecodeStack"),
                                reason="C++ kernels unavailable")


def _chunk(name: str, prompt_len: int, start: int, n: int, table: list[int]) -> tuple[Sequence, int]:
    seq = Sequence(name, list(range(40, 40 + prompt_len)), SamplingParams(max_tokens=8))
    seq.num_computed_tokens = start
    seq.block_table = table
    return seq, n


def _mixed_batch(decodes: int = 3) -> ScheduledBatch:
    """Plain decodes, then a chunk that ends its prompt (after a prefix hit) and one that does not."""
    batch = _plain_batch()
    batch.decodes = batch.decodes[:decodes]
    batch.prefills = [_chunk("ends", 10, 6, 4, [24, 25, 26]), _chunk("goes on", 9, 0, 2, [27, 28, 29])]
    return batch


def _both(runner, start, batch):
    runner.mixed_as_decode = True
    assert runner._chunks_as_decode_queries(batch())
    calls = []
    real = kernels.paged_attention
    try:
        kernels.paged_attention = lambda *a: calls.append(1) or real(*a)
        native = runner.execute(batch())
    finally:
        kernels.paged_attention = real
    assert not calls  # the decode stack ran the step, not the modules' prefill attention
    native_pool = _pool(runner)
    _restore(runner, start)
    runner.mixed_as_decode = False
    general = runner.execute(batch())
    return native, native_pool, general


@pytest.mark.parametrize("kinds, int8", [(None, False), (["Q4_K"], False), (["Q8_0"], False), (["Q4_K"], True)],
                         ids=["float32", "Q4_K", "Q8_0", "Q4_K-int8"])
def test_a_short_chunk_beside_decodes_gives_the_general_paths_bits(kinds, int8):
    if int8 and not int8_matmul_supported(kernels):
        pytest.skip("no int8 matmul on this CPU")
    model = _model()
    assert pack_linears(model, _quantized(model, kinds) if kinds else None, int8_activations=int8)
    runner, start = _runner(model)
    native, native_pool, general = _both(runner, start, _mixed_batch)
    assert [s.request_id for s in native.sampled] == ["p0", "p1", "p2", "ends"]
    assert native.logits.shape[0] == 4
    assert torch.equal(native.logits, general.logits)
    assert _same_pool(runner, native_pool)


def test_a_step_of_more_queries_takes_the_general_path():
    model = _model()
    assert pack_linears(model)
    runner, _ = _runner(model)
    batch = _mixed_batch(decodes=5)
    batch.prefills.append(_chunk("long", 12, 0, MIXED_AS_DECODE_QUERIES, [30, 31, 1]))
    assert not runner._chunks_as_decode_queries(batch)
    assert not runner._chunks_as_decode_queries(ScheduledBatch(prefills=_mixed_batch().prefills))  # no decodes


def test_requests_joining_running_ones_get_the_same_tokens_and_logprobs():
    """An engine whose requests arrive while others decode: the same greedy tokens and logprobs with
    the switch on and off, and the joining steps did run as decode queries."""
    from chatloom.models.loader import load_model

    loaded = load_model("smollm2-135m-instruct")
    results, taken = [], []
    for switch in (True, False):
        engine = LLMEngine(loaded, EngineConfig(max_num_batched_tokens=256, max_num_seqs=16, num_blocks=256))
        engine.runner.mixed_as_decode = switch
        decide = engine.runner._chunks_as_decode_queries
        engine.runner._chunks_as_decode_queries = lambda b: taken.append((switch, decide(b))) or taken[-1][1]
        rng, out, step, joined = random.Random(4), {}, 0, 0
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
        for i in range(3):
            engine.add_request([rng.randrange(300, 40000) for _ in range(20)], params, request_id=f"r{i}")
        while engine.has_unfinished_requests():
            if step % 3 == 1 and joined < 4:
                engine.add_request([rng.randrange(300, 40000) for _ in range(rng.randint(2, 6))], params,
                                   request_id=f"j{joined}")
                joined += 1
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = (list(o.token_ids), o.logprobs)
            step += 1
        results.append(out)
    assert results[0] == results[1]
    assert any(used for switch, used in taken if switch) and not any(used for switch, used in taken if not switch)
