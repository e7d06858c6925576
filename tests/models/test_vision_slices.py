"""The vision models' encoder run in slices of layers (embed_pieces, run_layers over consecutive ranges,
finish_pieces) gives what encoding the piece whole gives, for both families; and the hidden state between
slices has the size state_bytes says."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from chatloom.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_llava as tl  # noqa: E402
import tiny_vision as tv  # noqa: E402


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return load_model(str(tv.write_idefics3_folder(tmp_path_factory.mktemp("v") / "tiny", vision_layers=5)), "fp32")


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return load_model(str(tl.write_llava_folder(tmp_path_factory.mktemp("l") / "tiny-llava")), "fp32")


def _sliced(vision, prepared, indices: list[int], bounds: list[int]) -> torch.Tensor:
    hidden = vision.embed_pieces(prepared, indices)
    assert hidden.numel() * hidden.element_size() == len(indices) * vision.state_bytes
    for start, stop in zip(bounds, bounds[1:]):
        hidden = vision.run_layers(hidden, start, stop)
    return vision.finish_pieces(hidden)


@pytest.mark.parametrize("bounds", [[0, 1, 2, 3, 4, 5], [0, 2, 5], [0, 5]])
def test_idefics3_tiles_in_layer_slices_equal_the_whole_encoder(idefics3, bounds):
    vision = idefics3.vision
    assert vision.encoder_layers == 5
    prepared = vision.prepare(tv.test_image(71, 47, seed=3))
    whole = vision.encode_pieces(prepared, [0, 4])
    assert torch.equal(_sliced(vision, prepared, [0, 4], bounds), whole)
    # One tile alone, sliced, against the whole image's encoder (all tiles at once, as transformers runs it).
    everything = vision.encode(vision.preprocess(tv.test_image(71, 47, seed=3)))
    tile = vision.piece_tokens
    assert torch.allclose(_sliced(vision, prepared, [4], bounds), everything[4 * tile:5 * tile], atol=1e-5, rtol=0)


def test_a_llava_image_in_layer_slices_equals_the_whole_encoder(llava):
    vision = llava.vision
    layers = vision.encoder_layers
    assert layers == 2  # the tiny CLIP's 3 layers, read before the last
    prepared = vision.prepare(tv.test_image(50, 40, seed=4))
    assert torch.equal(_sliced(vision, prepared, [0], [0, 1, layers]), vision.encode(prepared))
    with pytest.raises(IndexError):
        vision.embed_pieces(prepared, [1])
