"""A piece's encoder layers in slices across steps: the hidden state between slices is kept in the encoder
cache (counted against its limit, pinned while partial, freed when its request goes), the tile becomes
readable only after its last slice, other requests get a token in every step meanwhile, and the answer is
the one the whole tile gives."""
from __future__ import annotations

import math
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
from test_vision_engine import GREEDY, _placed  # noqa: E402

LAYERS = 6
TEXT = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny Idefics3 with a 6-layer encoder and no tiling: an image is one tile of 4 embeddings."""
    folder = tv.write_idefics3_folder(tmp_path_factory.mktemp("slices") / "tiny", split=False, vision_layers=LAYERS)
    return load_model(str(folder), "fp32")


class OneLayerAStep(EncoderPacer):
    """A pacer that pays for one encoder layer of each piece in each shared step, whatever the clock says."""

    def slice_layers(self) -> int:
        return 1

    def affordable(self, planned: int, tokens: int, layers: int) -> int:
        return min(layers, 1)


def _engine(loaded, paced_by_layer: bool = True, **kw) -> LLMEngine:
    config = dict(num_blocks=64, block_size=16, enable_prefix_caching=False)
    engine = LLMEngine(loaded, EngineConfig(**{**config, **kw}))
    if paced_by_layer:
        engine.scheduler.encoder.pacer = engine.encoder_pacer = OneLayerAStep(0.2, LAYERS)
    return engine


def _finish(engine, rid):
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def _alone(loaded, ids, placed) -> list[int]:
    """The image request's answer on a fresh engine that encodes the tile whole."""
    engine = _engine(loaded, paced_by_layer=False)
    rid = engine.add_request(ids, GREEDY, images=placed)
    out = _finish(engine, rid)
    assert engine.runner.encoder_slices == engine.runner.encoder_pieces  # one slice a tile: all its layers
    return out.token_ids


def _start_stream(engine, loaded) -> str:
    text = engine.add_request(loaded.tokenizer.encode("a story"), TEXT)
    while engine.requests[text].seq.num_output_tokens < 1:
        engine.step()
    return text


def test_a_tile_in_layer_slices_beside_a_stream_gives_the_whole_tiles_embeddings_and_answer(deep):
    engine = _engine(deep)
    text = _start_stream(engine, deep)
    image = tv.test_image(40, 30, seed=21)
    ids, placed = _placed(deep, [image])
    assert placed[0].num_pieces == 1 and deep.vision.encoder_layers == LAYERS
    rid = engine.add_request(ids, GREEDY, images=placed)
    seq = engine.requests[rid].seq
    first = placed[0].positions[0]
    runner, cache = engine.runner, engine.encoder_cache
    slicing_steps = 0
    while runner.encoder_pieces == 0:
        slices = runner.encoder_slices
        outs = engine.step()
        if runner.encoder_slices > slices:
            slicing_steps += 1
            assert any(o.request_id == text and o.delta_token_ids for o in outs)  # the stream moved on
        if runner.encoder_pieces == 0:  # part-way: kept in the cache, not readable, not read
            assert cache.partial_count == 1 and (placed[0].content_hash, 0) not in cache
            assert seq.num_computed_tokens <= first
        assert slicing_steps <= LAYERS
    assert slicing_steps == LAYERS and runner.encoder_slices == LAYERS and cache.partial_count == 0
    # The sliced tile's embeddings are the whole tile's.
    sliced = cache.get((placed[0].content_hash, 0))
    whole = deep.vision.encode_pieces(deep.vision.prepare(image), [0])
    assert torch.allclose(sliced, whole, atol=1e-5, rtol=0)
    assert _finish(engine, rid).token_ids == _alone(deep, ids, placed)
    engine.abort(text)


def test_the_step_budget_alone_splits_a_tile_into_slices(deep):
    # Not paced: a budget of 2 tokens is 2 x 6 embedding-layers a step, 3 layers of a 4-embedding tile.
    engine = _engine(deep, paced_by_layer=False, max_num_batched_tokens=2, encoder_max_slowdown=math.inf)
    text = _start_stream(engine, deep)
    ids, placed = _placed(deep, [tv.test_image(30, 40, seed=22)])
    rid = engine.add_request(ids, GREEDY, images=placed)
    out = _finish(engine, rid)
    assert engine.runner.encoder_slices == 2 and engine.runner.encoder_pieces == 1
    assert out.token_ids == _alone(deep, ids, placed)
    engine.abort(text)


def test_a_partial_state_counts_against_the_cache_and_is_freed_on_abort(deep):
    engine = _engine(deep)
    cache, state = engine.encoder_cache, deep.vision.state_bytes
    assert state == 16 * 32 * 4  # a tile's 16 patches x the encoder's 32 floats
    text = _start_stream(engine, deep)
    ids, placed = _placed(deep, [tv.test_image(40, 30, seed=23)])
    rid = engine.add_request(ids, GREEDY, images=placed)
    while engine.runner.encoder_slices < 2:
        engine.step()
    key = (placed[0].content_hash, 0)
    assert cache.layers_done(key) == 2 and cache.bytes == state and cache.pinned_bytes == state
    engine.abort(rid)
    assert cache.partial_count == 0 and cache.bytes == 0 and cache.pinned_bytes == 0
    assert not engine.scheduler.encoder.pins
    engine.abort(text)


def test_a_second_partial_state_waits_for_room_in_the_cache(deep):
    # Room for one tile's partial state and its embeddings, not for two partial states.
    state = deep.vision.state_bytes
    limit = state + 4 * 32 * 4
    engine = _engine(deep, encoder_cache_mb=limit / 2**20)
    cache = engine.encoder_cache
    text = _start_stream(engine, deep)
    requests = [_placed(deep, [tv.test_image(40, 30, seed=seed)]) for seed in (24, 25)]
    rids = [engine.add_request(ids, GREEDY, images=placed) for ids, placed in requests]
    outs = {}
    while len(outs) < 2:
        for out in engine.step():
            if out.request_id in rids and out.finished:
                outs[out.request_id] = out.token_ids
        assert cache.partial_count <= 1 and cache.bytes <= limit
    assert engine.runner.encoder_pieces == 2 and engine.runner.encoder_slices == 2 * LAYERS
    assert [outs[r] for r in rids] == [_alone(deep, ids, placed) for ids, placed in requests]
    engine.abort(text)


def test_partial_states_in_the_cache():
    cache = EncoderCache(max_bytes=3 * 40)  # three 10-float tensors
    cache.put_partial(("a", 0), torch.zeros(10), 2)  # not pinned: nobody would continue it
    assert cache.partial_count == 0 and cache.bytes == 0
    cache.put(("old", 0), torch.zeros(10))
    cache.put(("older", 0), torch.zeros(10))
    cache.pin(("a", 0))
    cache.put_partial(("a", 0), torch.zeros(10), 2)
    cache.put_partial(("b", 0), torch.zeros(10), 1)  # not pinned either
    assert cache.layers_done(("a", 0)) == 2 and cache.layers_done(("b", 0)) == 0
    assert ("a", 0) not in cache and cache.get(("a", 0)) is None  # part-way: no embeddings to read
    assert cache.bytes == 120 and cache.pinned_bytes == 40
    cache.pin(("c", 0))
    cache.put_partial(("c", 0), torch.zeros(10), 3)  # evicts the least recently used finished entry
    assert ("old", 0) not in cache and ("older", 0) in cache and cache.bytes == 120
    cache.put_partial(("a", 0), torch.ones(10), 4)  # the next slice's state replaces the last
    assert cache.layers_done(("a", 0)) == 4 and torch.equal(cache.partial(("a", 0)), torch.ones(10))
    assert cache.bytes == 120 and cache.pinned_bytes == 80
    cache.put(("a", 0), torch.zeros(5))  # finished: its embeddings replace its state
    assert cache.layers_done(("a", 0)) == 0 and ("a", 0) in cache and cache.pinned_bytes == 60
    cache.unpin(("c", 0))  # its last pin gone: the state is dropped
    assert cache.partial_count == 0 and cache.pinned_bytes == 20 and cache.bytes == 60


def test_a_failing_slice_fails_its_request_alone(deep, monkeypatch):
    engine = _engine(deep)
    text = _start_stream(engine, deep)
    ids, placed = _placed(deep, [tv.test_image(40, 30, seed=26)])
    rid = engine.add_request(ids, GREEDY, images=placed)
    while engine.runner.encoder_slices < 2:  # part-way: its request reads nothing in the steps to come
        engine.step()

    def broken(hidden, start, stop):
        raise RuntimeError("a broken layer")
    monkeypatch.setattr(deep.vision, "run_layers", broken)
    out = None
    while out is None:
        outs = engine.step()
        assert any(o.request_id == text and o.delta_token_ids for o in outs)  # the stream carries on
        out = next((o for o in outs if o.request_id == rid and o.finished), None)
    assert out.finish_reason == "error" and "a broken layer" in out.error
    assert engine.encoder_cache.partial_count == 0 and engine.encoder_cache.bytes == 0
    engine.abort(text)
