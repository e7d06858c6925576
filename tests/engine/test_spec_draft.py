"""The draft-model proposer: greedy output stays token-identical to the target alone,
with chunked prefill, preemption and prefix-cache hits in play, and the draft's own
KV cache stays in step (a draft that is the target itself is always right, so any
drift in its cache would show as rejections)."""
from __future__ import annotations

import pytest

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.spec_decode.draft import first_layers

from test_spec_decode import CONFIGS, repeating_prompts, run


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_draft_model_is_token_identical(tiny_model, name):
    prompts = repeating_prompts(tiny_model.config.vocab_size, 12, seed=21)
    want, _ = run(tiny_model, prompts, "off", **CONFIGS[name])
    got, engine = run(tiny_model, prompts, "draft", speculative_model="self-layers:1", speculative_adaptive=False,
                      num_speculative_tokens=3, **CONFIGS[name])
    assert got == want
    stats = engine.get_stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    draft = engine.spec.proposer
    assert not draft.shadows and draft.kv.num_free_blocks == draft.kv.num_blocks


def test_a_draft_identical_to_the_target_is_always_accepted(tiny_model):
    """All its layers: the draft is the target, so its cache being in step after
    rejections (by max_tokens cuts), preemptions and prefix hits means every proposal is kept."""
    n = tiny_model.config.num_layers
    prompts = repeating_prompts(tiny_model.config.vocab_size, 10, seed=4)
    prompts = prompts + [p[:20] + [1, 2, 3] for p in prompts[:4]]  # prefix hits in both caches
    for config in (CONFIGS["tight-pool"], CONFIGS["chunked"]):
        want, _ = run(tiny_model, prompts, "off", **config)
        got, engine = run(tiny_model, prompts, "draft", speculative_model=f"self-layers:{n}",
                          speculative_adaptive=False, num_speculative_tokens=4, **config)
        assert got == want
        stats = engine.get_stats()
        assert stats["spec_decode_num_draft_tokens"] > 50
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


def test_sampled_with_a_draft_model_runs_and_is_seed_reproducible(tiny_model):
    prompts = repeating_prompts(tiny_model.config.vocab_size, 4, seed=8)
    params = [SamplingParams(max_tokens=20, temperature=0.5, seed=i, ignore_eos=True) for i in range(4)]
    outs = []
    for _ in range(2):
        engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256, speculative="draft", speculative_adaptive=False,
                                                    speculative_model="self-layers:1"))
        outs.append([o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
    assert engine.get_stats()["spec_decode_num_draft_tokens"] > 0


def test_bad_draft_models_are_named(tiny_model):
    with pytest.raises(ValueError, match="layers"):
        LLMEngine(tiny_model, EngineConfig(speculative="draft", speculative_model="self-layers:9", num_blocks=64))
    with pytest.raises(ValueError, match="needs a speculative model"):
        LLMEngine(tiny_model, EngineConfig(speculative="draft", num_blocks=64))
    with pytest.raises(ValueError, match="unknown speculative mode"):
        LLMEngine(tiny_model, EngineConfig(speculative="medusa", num_blocks=64))


def test_first_layers_shares_weights(tiny_model):
    draft = first_layers(tiny_model.model, 1)
    assert draft.config.num_layers == 1 and len(draft.layers) == 1 and len(tiny_model.model.layers) == 2
    assert draft.lm_head.weight is tiny_model.model.lm_head.weight
