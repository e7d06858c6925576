"""A model whose every layer attends within a window gives back the KV blocks that leave it: a long
generation holds a bounded number of blocks, and its tokens are those of the path that keeps them all."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models.loader import LoadedModel, load_model
from chatloom.models.registry import tiny_random_config
from chatloom.models.weights import random_model

WINDOW = 20
BLOCK = 4


@pytest.fixture(scope="module")
def windowed() -> LoadedModel:
    cfg = tiny_random_config()
    tok = load_model("tiny-random", "fp64").tokenizer
    cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size, layer_windows=[WINDOW] * cfg.num_layers,
                              name="tiny-windowed")
    return LoadedModel("tiny-windowed", random_model(cfg, torch.float64, seed=3), tok, cfg, 0.0)


def _run(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, free: bool, **config):
    engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK, **config))
    if not free:
        engine.kv_cache_manager.window = None  # the path that keeps every block
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    most_held = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
        most_held = max(most_held, engine.kv_cache_manager.held_blocks)
    assert engine.kv_cache_manager.held_blocks == 0  # every block back once the requests end
    return [tokens[i] for i in ids], most_held, engine


@pytest.mark.parametrize("caching", [True, False])
def test_a_long_generation_holds_about_a_window_of_blocks(windowed, caching):
    prompt = list(range(40, 70))
    kept, kept_held, _ = _run(windowed, [prompt], 200, free=False, num_blocks=128, enable_prefix_caching=caching)
    freed, freed_held, engine = _run(windowed, [prompt], 200, free=True, num_blocks=128,
                                     enable_prefix_caching=caching)
    assert freed == kept
    assert kept_held >= (30 + 200 - 2) // BLOCK  # every block of the sequence (its last token needs none)
    # The window's blocks, the one being filled, and (with caching) the last published one.
    assert freed_held <= -(-WINDOW // BLOCK) + 3
    assert engine.kv_cache_manager.released_blocks > 0


def test_a_conversation_longer_than_the_pool_runs_to_its_end(windowed):
    # 16 blocks of 4 hold 64 tokens; the sequences grow to 230 and 190 tokens, side by side.
    prompts = [list(range(40, 70)), list(range(100, 110))]
    kept, _, _ = _run(windowed, prompts, 180, free=False, num_blocks=256)
    freed, held, engine = _run(windowed, prompts, 180, free=True, num_blocks=16, max_num_seqs=2)
    assert freed == kept and held <= 16
    assert engine.kv_cache_manager.num_blocks == 16


def test_released_blocks_serve_a_later_prompt_from_the_prefix_cache(windowed):
    prompt = list(range(40, 100))
    engine = LLMEngine(windowed, EngineConfig(block_size=BLOCK, num_blocks=64))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    (first,) = engine.generate([prompt], params, use_tqdm=False)
    assert engine.kv_cache_manager.released_blocks > 0
    (again,) = engine.generate([prompt], params, use_tqdm=False)
    assert again.token_ids == first.token_ids
    assert engine.kv_cache_manager.hit_tokens > 0  # the released blocks kept their contents and keys


def test_a_model_with_full_attention_layers_keeps_its_blocks(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(block_size=BLOCK, num_blocks=128))
    assert engine.kv_cache_manager.window is None
    engine.generate([list(range(40, 70))], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                    use_tqdm=False)
    assert engine.kv_cache_manager.released_blocks == 0
