"""Encoder work in pieces inside the step's budget: an image's tiles are encoded a few at a time, the
prefill runs up to the first piece not ready, other sequences keep decoding, the encoder cache keeps
to its limit with the pieces in flight pinned, and a second question reuses the cached pieces."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.encoder_cache import EncoderCache
from chatloom.engine.encoder_plan import EncoderPacer
from chatloom.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_vision as tv  # noqa: E402
from test_vision_engine import GREEDY, _expanded, _placed, _run  # noqa: E402

TEXT = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
PIECE_BYTES = 4 * 32 * 4  # a tile's 4 embeddings of the tiny decoder's 32 floats


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(str(tv.write_idefics3_folder(tmp_path_factory.mktemp("pieces") / "tiny")), "fp32")


def _alone(loaded, ids, placed):
    """The image request's answer on a fresh engine with room for everything."""
    return _run(LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, enable_prefix_caching=False)),
                ids, placed).token_ids


def _steps(engine, until):
    """Step until `until()` holds; per step: (embeddings encoded, request ids that got a token)."""
    log = []
    while not until():
        before = engine.runner.encoder_tokens
        outs = engine.step()
        log.append((engine.runner.encoder_tokens - before, {o.request_id for o in outs if o.delta_token_ids}))
        assert len(log) < 2000, "the engine made no progress"
    return log


def test_pieces_stay_inside_the_step_budget(loaded):
    # Two images of 17 tiles (68 embeddings) each, a step budget of 16 tokens: 4 tiles a step at most.
    ids, placed = _placed(loaded, [tv.test_image(20, 20, seed=9), tv.test_image(20, 20, seed=10)])
    assert [(p.num_tokens, p.num_pieces) for p in placed] == [(68, 17), (68, 17)]
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=16))
    engine.add_request(ids, GREEDY, images=placed)
    log = _steps(engine, lambda: not engine.has_unfinished_requests())
    encoded = [n for n, _ in log if n]
    # A chunk of 16 tokens reaches at most 3 tiles' runs between their tags: the pieces it reaches.
    assert max(encoded) <= 16 and sum(encoded) == 2 * 68 and len(encoded) >= 2 * 68 // 16
    assert engine.runner.encoder_pieces == 34


def test_an_image_larger_than_the_budget_is_encoded_while_another_sequence_decodes(loaded):
    # Any slowdown allowed: the pacer's cap alone leaves one piece per step that carries a decode.
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=16,
                                            encoder_max_slowdown=1e9))
    text = engine.add_request(loaded.tokenizer.encode("a story"), TEXT)
    _steps(engine, lambda: engine.requests[text].seq.num_output_tokens >= 1)  # the stream is decoding
    ids, placed = _placed(loaded, [tv.test_image(20, 20, seed=11)])
    image = engine.add_request(ids, GREEDY, images=placed)
    seq = engine.requests[image].seq
    log = _steps(engine, lambda: seq.num_computed_tokens >= placed[0].positions[-1] + 1)
    encoding = [got for n, got in log if n]
    assert len(encoding) >= 68 // 16 + 1  # more steps than the budget alone would need
    assert all(text in got for _, got in log)  # the stream got a token in every step, encoding or not
    assert engine.runner.encoder_pieces == 17
    out = None
    while out is None:
        out = next((o for o in engine.step() if o.request_id == image and o.finished), None)
    assert out.token_ids == _alone(loaded, ids, placed)
    engine.abort(text)


def test_with_no_slowdown_allowed_the_image_waits_for_the_streams(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, encoder_max_slowdown=0))
    text = engine.add_request(loaded.tokenizer.encode("a story"), SamplingParams(temperature=0.0, max_tokens=12,
                                                                                ignore_eos=True))
    _steps(engine, lambda: engine.requests[text].seq.num_output_tokens >= 1)
    ids, placed = _placed(loaded, [tv.test_image(20, 20, seed=12)])
    image = engine.add_request(ids, GREEDY, images=placed)
    seq = engine.requests[image].seq
    # The text before the image is read at once; the prefill then stops at the first tile, unencoded.
    _steps(engine, lambda: seq.num_computed_tokens > 0)
    assert seq.num_computed_tokens == placed[0].positions[0] and engine.runner.encoder_pieces == 0
    log = _steps(engine, lambda: text not in engine.requests)
    assert all(n == 0 for n, _ in log)  # nothing encoded while the stream ran
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == image and o.finished:
                out = o
    assert engine.runner.encoder_pieces == 17 and out.token_ids == _alone(loaded, ids, placed)


def test_another_request_reading_its_prompt_is_waited_for_too(loaded):
    # A long text prompt arriving with the image: encoding now would delay its first token.
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=16,
                                            encoder_max_slowdown=0))
    ids, placed = _placed(loaded, [tv.test_image(20, 20, seed=15)])
    image = engine.add_request(ids, GREEDY, images=placed)
    text = engine.add_request(loaded.tokenizer.encode("a long story " * 8), SamplingParams(temperature=0.0,
                                                                                           max_tokens=2))
    log = _steps(engine, lambda: text not in engine.requests)
    assert all(n == 0 for n, _ in log) and engine.runner.encoder_pieces == 0
    _steps(engine, lambda: image not in engine.requests)
    assert engine.runner.encoder_pieces == 17


@pytest.mark.parametrize("slowdown", [0.2, 0])
def test_images_waiting_only_for_each_other_are_encoded(loaded, slowdown):
    # Two image requests and nothing else: a step the pacing would leave empty encodes unpaced.
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, encoder_max_slowdown=slowdown))
    first, second = (_placed(loaded, [tv.test_image(20, 20, seed=seed)]) for seed in (16, 17))
    ids = [engine.add_request(p[0], GREEDY, images=p[1]) for p in (first, second)]
    _steps(engine, lambda: not engine.has_unfinished_requests())
    assert engine.runner.encoder_pieces == 34 and not any(i in engine.requests for i in ids)


@pytest.mark.parametrize("pieces", [6, 0.25])
def test_the_cache_keeps_to_its_limit_with_pieces_in_flight(loaded, pieces):
    # Room for 6 tiles' embeddings (under the 16-token budget's 4 a step and those pinned), or for
    # less than one: each piece is then kept only until its prefill has read it.
    limit = int(pieces * PIECE_BYTES)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=16,
                                            encoder_cache_mb=limit / 2**20, enable_prefix_caching=False))
    assert engine.encoder_cache.max_bytes == limit
    ids, placed = _placed(loaded, [tv.test_image(20, 20, seed=13)])
    rid = engine.add_request(ids, GREEDY, images=placed)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
        assert engine.encoder_cache.bytes <= max(limit, PIECE_BYTES)
    assert out.token_ids == _alone(loaded, ids, placed)
    assert engine.runner.encoder_pieces == 17  # no piece evicted before its prefill read it
    assert engine.encoder_cache.bytes <= limit and engine.encoder_cache.pinned_bytes == 0


def test_a_second_question_reuses_the_cached_pieces(loaded):
    # Room for 10 of the 13 tiles: the second question encodes only the ones evicted.
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, encoder_cache_mb=10 * PIECE_BYTES / 2**20,
                                            enable_prefix_caching=False))
    image = tv.test_image(71, 47, seed=14)
    _run(engine, *_placed(loaded, [image], "What is it?"))
    assert engine.runner.encoder_pieces == 13 and len(engine.encoder_cache) == 10
    ids, placed = _placed(loaded, [image], "And its colour?")
    second = _run(engine, ids, placed)
    assert 13 < engine.runner.encoder_pieces < 26
    assert second.token_ids == _alone(loaded, ids, placed)


def test_the_pacer_gives_the_encoder_its_share_of_decoding_steps():
    pacer = EncoderPacer(0.2, layers=12)
    pacer.piece_tokens = 64
    # Nothing measured yet: one layer of one piece, which measures the cost.
    assert pacer.slice_layers() == 1 and pacer.affordable(0, 64, 12) == 1 and pacer.affordable(64, 64, 12) == 0
    pacer.record(shared=True, step_s=1.01, encoder_s=1.0, encoder_work=64)  # a piece's layer costs 1 s
    assert pacer.affordable(0, 64, 12) == 0
    steps = 0
    while not pacer.affordable(0, 64, 12):  # decoding steps of 10 ms: 2 ms of credit each
        pacer.record(shared=True, step_s=0.01, encoder_s=0.0, encoder_work=0)
        steps += 1
    # The first layer's second went on credit: two seconds to earn, 5 s of decoding per second encoded.
    assert steps == pytest.approx(1000, abs=2)
    for _ in range(100):
        pacer.record(shared=True, step_s=0.01, encoder_s=0.0, encoder_work=0)
    # Capped at one slice: with 10 ms steps against 1 s a layer, a slice is one layer.
    assert pacer.slice_layers() == 1 and pacer.credit == pytest.approx(1.0) and pacer.affordable(0, 64, 12) == 1
    # Steps long beside a layer make longer slices: what 4 steps earn (0.2 x 2.5 s x 4 = 2 layers).
    pacer.step_s = 2.5
    assert pacer.slice_layers() == 2
    # A step for one request alone delays nobody: no credit taken or given.
    pacer.record(shared=False, step_s=2.0, encoder_s=2.0, encoder_work=128)
    assert pacer.credit == pytest.approx(1.0)
    assert EncoderPacer(0.0).affordable(0, 1, 1) == 0
    unpaced = EncoderPacer(float("inf"), layers=12)
    assert unpaced.slice_layers() == 12 and unpaced.affordable(10**6, 64, 12) == 12


def test_pinned_pieces_are_not_evicted():
    cache = EncoderCache(max_bytes=2 * 40)  # two 10-float pieces
    cache.pin(("a", 0))
    cache.put(("a", 0), torch.zeros(10))
    cache.put(("b", 0), torch.zeros(10))
    cache.put(("c", 0), torch.zeros(10))  # evicts b, never the pinned a
    assert ("a", 0) in cache and ("b", 0) not in cache and cache.pinned_bytes == 40
    cache.pin(("d", 0))
    cache.put(("d", 0), torch.zeros(10))
    assert ("a", 0) in cache and ("d", 0) in cache and ("c", 0) not in cache
    cache.put(("e", 0), torch.zeros(10))  # no room beside two pinned pieces: not kept
    assert ("e", 0) not in cache and cache.bytes == 80
    cache.unpin(("a", 0))
    cache.unpin(("d", 0))
    assert cache.pinned_bytes == 0
    big = EncoderCache(max_bytes=20)
    big.pin(("x", 0))
    big.put(("x", 0), torch.zeros(10))  # larger than the limit, kept while pinned
    assert ("x", 0) in big
    big.unpin(("x", 0))
    assert ("x", 0) not in big and big.bytes == 0


def _image_first(loaded, image):
    """A prompt that opens with the image, so the text before its first tile is shorter than a tile."""
    return _expanded(loaded, "<image>What is it?", [image])


def test_a_short_chunk_waits_to_be_read_with_its_piece(loaded):
    # Beside a decoding stream, the image's text before a tile (its tags) is read with that tile, never
    # in a step of its own: each chunk of the image's prompt reads at least a tile's worth.
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, encoder_max_slowdown=1e9))
    text = engine.add_request(loaded.tokenizer.encode("a story"), TEXT)
    _steps(engine, lambda: engine.requests[text].seq.num_output_tokens >= 1)
    ids, placed = _image_first(loaded, tv.test_image(20, 20, seed=18))
    piece = placed[0].piece_len
    assert 0 < placed[0].positions[0] < piece  # the tags before the first tile are shorter than it
    image = engine.add_request(ids, GREEDY, images=placed)
    seq = engine.requests[image].seq
    chunks = []
    while seq.num_computed_tokens < len(ids):
        before = seq.num_computed_tokens
        outs = engine.step()
        assert text in {o.request_id for o in outs if o.delta_token_ids}  # the stream moves every step
        if seq.num_computed_tokens > before:
            chunks.append(seq.num_computed_tokens - before)
        assert len(chunks) < 200
    assert min(chunks) >= piece and sum(chunks) == len(ids)
    out = None
    while out is None:
        out = next((o for o in engine.step() if o.request_id == image and o.finished), None)
    engine.abort(text)
    assert out.token_ids == _alone(loaded, ids, placed)


def test_a_request_behind_a_waiting_image_is_not_held_up(loaded):
    # The image request waits for the stream to end (no encoder time beside it) with its short text
    # held back; a text request that arrives after it still runs now.
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, encoder_max_slowdown=0))
    stream = engine.add_request(loaded.tokenizer.encode("a story"), TEXT)
    _steps(engine, lambda: engine.requests[stream].seq.num_output_tokens >= 1)
    ids, placed = _image_first(loaded, tv.test_image(20, 20, seed=19))
    image = engine.add_request(ids, GREEDY, images=placed)
    later = engine.add_request(loaded.tokenizer.encode("hello"), SamplingParams(temperature=0.0, max_tokens=2))
    _steps(engine, lambda: later not in engine.requests)
    assert engine.requests[image].seq.num_computed_tokens == 0 and engine.runner.encoder_pieces == 0
    assert engine.requests[stream].seq.num_output_tokens < 20
    engine.abort(stream)
    _steps(engine, lambda: image not in engine.requests)
    assert engine.runner.encoder_pieces == 17


def test_a_short_chunk_that_would_not_fit_with_its_piece_is_read_at_once(loaded):
    # A budget of 5 tokens: the 2-token opening and its 4-token tile do not fit one step together, so
    # holding the opening back would cost the image request a step; it is read beside the stream at once.
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=5,
                                            encoder_max_slowdown=0))
    stream = engine.add_request(loaded.tokenizer.encode("a story"), TEXT)
    _steps(engine, lambda: engine.requests[stream].seq.num_output_tokens >= 1)
    ids, placed = _image_first(loaded, tv.test_image(20, 20, seed=20))
    image = engine.add_request(ids, GREEDY, images=placed)
    engine.step()
    assert engine.requests[image].seq.num_computed_tokens == placed[0].positions[0] == 2
    engine.abort(stream)
    _steps(engine, lambda: image not in engine.requests)
    assert engine.runner.encoder_pieces == 17
