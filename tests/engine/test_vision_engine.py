"""Images in the engine: the encoder cache (a second question about the same image runs no encoder,
under a memory limit) and prefix-cache keys that include the image. Encoder work in pieces inside the
step's budget: test_encoder_pieces.py."""
from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.encoder_cache import EncoderCache
from chatloom.models import load_model
from chatloom.models.chat_template import render_chat
from chatloom.models.vision.images import content_hash
from chatloom.models.vision.prompt import expand_images

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import tiny_vision as tv  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(str(tv.write_idefics3_folder(tmp_path_factory.mktemp("vision") / "tiny")), "fp32")


def _placed(loaded, images, question="What is it?"):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    return _expanded(loaded, render_chat(loaded.tokenizer.chat_template, [{"role": "user", "content": content}]),
                     images)


def _expanded(loaded, text, images):
    """Token ids of `text` with its image markers expanded for `images`, and their placements."""
    pairs = []
    for image in images:
        buf = io.BytesIO()
        image.save(buf, "PNG")
        pairs.append((content_hash(buf.getvalue()), image))
    return expand_images(loaded.vision, loaded.tokenizer, text, pairs)


def _run(engine, ids, images, params=GREEDY):
    rid = engine.add_request(ids, params, images=images)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError("no output")


def test_second_question_about_the_same_image_runs_no_encoder(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16))
    image = tv.test_image(71, 47, seed=5)
    first = _run(engine, *_placed(loaded, [image], "What is it?"))
    assert engine.runner.encoder_runs == 1
    second = _run(engine, *_placed(loaded, [image], "And its colour?"))
    assert engine.runner.encoder_runs == 1
    # Both prompts share the image's blocks: the second takes all of them from the prefix cache.
    ids, placed = _placed(loaded, [image])
    assert second.num_cached_tokens > placed[0].positions[-1]
    assert first.num_cached_tokens == 0


def test_without_the_prefix_cache_the_encoder_cache_answers(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, enable_prefix_caching=False))
    image = tv.test_image(71, 47, seed=5)
    first = _run(engine, *_placed(loaded, [image], "What is it?"))
    assert engine.runner.encoder_pieces == 13  # 3 x 4 tiles and the global view
    again = _run(engine, *_placed(loaded, [image], "What is it?"))
    assert engine.runner.encoder_runs == 1 and engine.runner.encoder_pieces == 13
    assert engine.encoder_cache.hits >= 13
    assert again.token_ids == first.token_ids and again.num_cached_tokens == 0


def test_another_image_in_the_same_place_reuses_no_image_block(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16))
    a, b = tv.test_image(71, 47, seed=6), tv.test_image(71, 47, seed=7)
    ids_a, placed_a = _placed(loaded, [a])
    ids_b, placed_b = _placed(loaded, [b])
    assert ids_a == ids_b  # the same token ids: only the image differs
    out_a = _run(engine, ids_a, placed_a)
    out_b = _run(engine, ids_b, placed_b)
    first_image_block = placed_b[0].positions[0] // 16
    assert out_b.num_cached_tokens <= placed_b[0].positions[0]
    assert out_b.num_cached_tokens >= first_image_block * 16 - 16
    assert engine.runner.encoder_runs == 2
    # And the answers are each image's own, as a fresh engine gives them.
    fresh = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, enable_prefix_caching=False))
    assert _run(fresh, ids_b, placed_b).token_ids == out_b.token_ids
    assert _run(fresh, ids_a, placed_a).token_ids == out_a.token_ids


def test_encoder_cache_keeps_to_its_memory_limit():
    import torch
    cache = EncoderCache(max_bytes=3 * 4 * 10)  # three 10-float embeddings
    for i in range(5):
        cache.put(f"h{i}", torch.zeros(10))
    assert len(cache) == 3 and cache.bytes == 120 and cache.evictions == 2
    assert "h0" not in cache and "h4" in cache
    cache.get("h2")  # used: the next eviction takes h3
    cache.put("h5", torch.zeros(10))
    assert "h2" in cache and "h3" not in cache
    cache.put("big", torch.zeros(31))  # larger than the whole limit: not kept, nothing evicted
    assert "big" not in cache and len(cache) == 3


def test_engine_with_a_small_encoder_cache_encodes_again(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, encoder_cache_mb=0,
                                            enable_prefix_caching=False))
    image = tv.test_image(40, 40, seed=8)
    first = _run(engine, *_placed(loaded, [image]))
    second = _run(engine, *_placed(loaded, [image]))
    assert engine.runner.encoder_runs == 2 and first.token_ids == second.token_ids


def test_a_text_model_refuses_images(tiny_model_fp32, loaded):
    engine = LLMEngine(tiny_model_fp32, EngineConfig(num_blocks=16, block_size=16))
    _, placed = _placed(loaded, [tv.test_image(20, 20)])
    with pytest.raises(Exception, match="does not take images"):
        engine.add_request([1, 2, 3], GREEDY, images=placed)
