"""Greedy decoding through the engine (paged KV cache, continuous batching, chunked
prefill, prefix caching) produces the same tokens as greedy decoding that recomputes
the whole sequence with the cache-free reference forward pass at every step."""
from __future__ import annotations

import pytest
import torch

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models.kernels import load_kernels


def reference_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens for each prompt, recomputing every sequence from scratch each step."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        for s, logits in zip(seqs, model.dense_logits(seqs)):
            s.append(int(logits[-1].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def engine_greedy(loaded, prompts: list[list[int]], n: int, **config) -> list[list[int]]:
    engine = LLMEngine(loaded, EngineConfig(**config))
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in outs)
    return [o.token_ids for o in outs]


TINY_PROMPTS = [[1, 2, 3], list(range(10, 50)), [7] * 17, list(range(100, 133)), [42]]


@pytest.mark.parametrize("config", [
    {"num_blocks": 64},
    # Tiny blocks and a tiny step budget: many block boundaries, chunked prefills mixed with decodes.
    {"num_blocks": 128, "block_size": 4, "max_num_batched_tokens": 8},
    # A pool too small for everyone at once: requests wait or are preempted and recomputed.
    {"num_blocks": 12, "block_size": 8, "max_num_seqs": 3},
], ids=["default", "small-blocks-chunked", "tight-pool"])
def test_tiny_model_engine_equals_recompute(tiny_model, config):
    n = 24
    want = reference_greedy(tiny_model.model, TINY_PROMPTS, n)
    got = engine_greedy(tiny_model, TINY_PROMPTS, n, **config)
    assert got == want  # float64: no near ties to excuse


def test_tiny_model_shared_prefixes_equal_recompute(tiny_model):
    """Prompts sharing whole blocks reuse cached K/V; the tokens must not change."""
    base = list(range(200, 240))
    prompts = [base + [1], base + [2, 3], base[:32] + [4], base + [1]]
    want = reference_greedy(tiny_model.model, prompts, 12)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = engine.generate(prompts[:1], params, use_tqdm=False)
    rest = engine.generate(prompts[1:], params, use_tqdm=False)
    assert [o.token_ids for o in first + rest] == want
    assert engine.get_stats()["prefix_cache_hits"] > 0


def test_tiny_model_part_of_a_block_reused_equals_recompute(tiny_model):
    """Prompts that share 24 tokens, a block and a half: the half is copied from the first prompt's
    cached block into the next prompts' own (as every chat shares its template's system prompt)."""
    shared = list(range(100, 124))
    prompts = [shared + [5, 6, 7, 8, 9, 10, 11, 12, 13], shared + [40, 41], shared[:20] + [50, 51, 52]]
    want = reference_greedy(tiny_model.model, prompts, 12)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=16))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    copies = []
    copy = engine.kv_cache_manager.copy_prefix
    engine.kv_cache_manager.copy_prefix = lambda *a: (copies.append(a), copy(*a))
    got = [engine.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in got] == want
    assert [n for _, _, n in copies] == [8, 4]  # tokens 16-23 of the second prompt, 16-19 of the third
    assert engine.get_stats()["prefix_cache_hits"] == (16 + 8) + (16 + 4)


def test_real_model_engine_equals_recompute(smollm2):
    """On the real model (fp32), checked teacher-forced to save 15 forward passes: one
    reference pass over prompt + engine output gives, at every position, the logits that
    recomputing that prefix would give (the model is causal), so each engine token must
    be the reference argmax there; a different token is allowed only at a near tie."""
    tok = smollm2.tokenizer
    texts = ["The capital of France is", "Once upon a time, there was a little",
             "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"]
    prompts = [tok.encode(t) for t in texts]
    n = 16
    got = engine_greedy(smollm2, prompts, n, num_blocks=64)
    full = smollm2.model.dense_logits([p + g for p, g in zip(prompts, got)])
    for i, (p, g, logits) in enumerate(zip(prompts, got, full)):
        rows = logits[len(p) - 1:len(p) - 1 + n].double()  # the logits that chose each output token
        best = rows.argmax(-1).tolist()
        for k, (token, row) in enumerate(zip(g, rows)):
            if token != best[k]:
                gap = float(row[best[k]] - row[token])
                assert gap < 1e-3, f"prompt {i}: token {k} is {token}, reference argmax {best[k]} (gap {gap:.2e})"
                break  # past a legitimate coin flip the continuations may differ
    assert "Paris" in tok.decode(got[0])


def _prompt_logits(loaded, prompt: list[int], warm: list[int] | None = None, **config) -> tuple[torch.Tensor, int]:
    """The logits the engine computes after `prompt`'s prefill (after `warm`'s, for a prefix-cache hit),
    and the engine's prefix-cache hits."""
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, **config))
    seen = []
    execute = engine.runner.execute

    def capture(batch):
        result = execute(batch)
        seen.append(result.logits.clone())
        return result

    params = SamplingParams(max_tokens=1, temperature=1.0, seed=0)  # sampled: the step returns its logits
    if warm is not None:  # it decodes a few tokens, so its prompt's blocks are published before it ends
        engine.generate([warm], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    engine.runner.execute = capture
    engine.generate([prompt], params, use_tqdm=False)
    return seen[-1], engine.get_stats()["prefix_cache_hits"]


@pytest.mark.parametrize("model", ["tiny_model_fp32", "smollm2"])
def test_a_prompts_bits_do_not_depend_on_how_it_was_prefilled(model, request):
    # With the C++ kernels every prefill query attends through the paged kernel with a decode step's
    # arithmetic: the prompt in one step, in chunks of 8 or 40 tokens, or after 64 of its tokens came
    # from the prefix cache, gives the very same logits.
    if load_kernels() is None:
        pytest.skip("C++ kernels unavailable")
    loaded = request.getfixturevalue(model)
    prompt = [(7 * i + 3) % 200 + 10 for i in range(100)]
    whole, _ = _prompt_logits(loaded, prompt)
    assert torch.equal(_prompt_logits(loaded, prompt, max_num_batched_tokens=8, block_size=8)[0], whole)
    assert torch.equal(_prompt_logits(loaded, prompt, max_num_batched_tokens=40)[0], whole)
    hit, hits = _prompt_logits(loaded, prompt, warm=prompt[:64] + [1, 2, 3])
    assert hits > 0
    assert torch.equal(hit, whole)


def _first_step(loaded, prompts: list[list[int]], keep_rows: bool) -> tuple[torch.Tensor, list, list[int]]:
    """One engine step over `prompts` (a budget that fits all but the last prompt's tail): the logits it
    returns, the K/V pools after it, and how many rows each layer's feed-forward computed. With
    keep_rows off the model computes every row of the last layer, as it did before rows were kept."""
    model = loaded.model
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, max_num_batched_tokens=64))
    seen, mlp_rows = [], []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch: (seen.append(r := execute(batch)), r)[1]
    hooks = [layer.mlp.register_forward_pre_hook(lambda _, args: mlp_rows.append(args[0].shape[0]))
             for layer in model.layers]
    forward = type(model).forward
    if not keep_rows:
        model.forward = lambda ids, pos, batch, kv=None, keep_rows=None: (
            lambda h: h if keep_rows is None else h[keep_rows])(forward(model, ids, pos, batch, kv))
    try:
        for p in prompts:  # sampled: the step returns its logits
            engine.add_request(p, SamplingParams(max_tokens=2, temperature=1.0, seed=0))
        engine.step()
    finally:
        for h in hooks:
            h.remove()
        model.__dict__.pop("forward", None)
    pools = [(k.clone(), v.clone()) for k, v in engine.runner.kv_caches]
    return seen[0].logits.clone(), pools, mlp_rows


@pytest.mark.parametrize("model", ["tiny_model", "tiny_model_fp32"])
def test_a_prefill_steps_last_layer_runs_only_the_rows_that_give_logits(model, request):
    """Past the last layer's K/V projection only a prompt's last row is read, so the last layer's
    feed-forward runs for those rows alone: the same logits (to the bit with the C++ kernels, whose
    rows are independent; PyTorch's float64 matmul may block fewer rows differently), the same K/V in
    the pools (every row's), and the prompt still in flight (its first chunk) gives no row at all."""
    loaded = request.getfixturevalue(model)
    prompts = [list(range(10, 50)), [7] * 17, list(range(100, 133))]  # 40 + 17 + 7 of 33 fit in 64
    logits, pools, rows = _first_step(loaded, prompts, keep_rows=True)
    all_logits, all_pools, all_rows = _first_step(loaded, prompts, keep_rows=False)
    layers = len(loaded.model.layers)
    assert rows == [64] * (layers - 1) + [2]
    assert all_rows == [64] * layers
    assert logits.shape[0] == 2
    if loaded.model.embed_tokens.weight.dtype == torch.float32 and load_kernels() is not None:
        assert torch.equal(logits, all_logits)
    else:
        torch.testing.assert_close(logits, all_logits)
    for (k, v), (k_all, v_all) in zip(pools, all_pools):
        assert torch.equal(k, k_all) and torch.equal(v, v_all)
