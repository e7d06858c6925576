"""LLaVA (the LLaVA-1.5 shape) through chatloom against transformers, on a tiny random checkpoint built
offline: the same pixel values, prompt tokens, image embeddings and greedy tokens."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models import load_model
from chatloom.models.chat_template import render_chat

import tiny_llava as tl
import tiny_vision as tv

MESSAGES = tv.ONE_IMAGE_QUESTION


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tl.write_llava_folder(tmp_path_factory.mktemp("llava") / "tiny-llava")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    return LlavaForConditionalGeneration.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def loaded(folder):
    return load_model(str(folder), "fp32")


def generate(engine: LLMEngine, ids: list[int], placed, n: int = 12) -> list[int]:
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), images=placed)
    got = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                got = o.token_ids
    return got


def hf_greedy(hf, text: str, image, n: int = 12) -> tuple[list[int], list[int]]:
    model, processor = hf
    inputs = processor(text=text, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("size,mode", [((71, 47), "RGB"), ((20, 90), "RGB"), ((32, 32), "RGB"),
                                       ((300, 129), "RGBA"), ((64, 40), "L"), ((33, 200), "P")])
def test_pixel_values_match_the_processor(hf, loaded, size, mode, pad):
    image = tv.test_image(*size, mode="RGB" if mode == "P" else mode)
    if mode == "P":
        image = image.convert("P")
    processor = hf[1].image_processor
    want = processor(images=[image], return_tensors="np", do_pad=pad)["pixel_values"]
    ours = loaded.vision.processor
    ours.pad_to_square = pad
    try:
        got = ours(image)
    finally:
        ours.pad_to_square = False
    assert got.shape == want.shape == (1, 3, tl.IMAGE, tl.IMAGE)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_image_embeddings_match_transformers(hf, loaded):
    model, processor = hf
    image = tv.test_image(71, 47)
    inputs = processor(text="<image>", images=[image], return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(inputs["pixel_values"]).pooler_output[0]
    got = loaded.vision.encode(loaded.vision.preprocess(image))
    assert got.shape == (16, 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_prompt_tokens_match_the_processor(hf, loaded):
    images = [tv.test_image(71, 47, seed=1), tv.test_image(20, 20, seed=2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                             {"type": "image"}, {"type": "text", "text": "?"}]}]
    text = render_chat(loaded.tokenizer.chat_template, messages, add_generation_prompt=True)
    want = hf[1](text=text, images=images, return_tensors="pt")["input_ids"][0].tolist()
    ids, placed = tv.expand(loaded, text, images)
    assert ids == want
    assert [i.num_tokens for i in placed] == [16, 16]


@pytest.mark.parametrize("size", [(71, 47), (24, 24)])
def test_greedy_tokens_match_transformers(hf, loaded, size):
    image = tv.test_image(*size, seed=3)
    text = render_chat(loaded.tokenizer.chat_template, MESSAGES, add_generation_prompt=True)
    want_ids, want = hf_greedy(hf, text, image)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=16))
    ids, placed = tv.expand(loaded, text, [image])
    assert ids == want_ids
    assert generate(engine, ids, placed) == want
    # Without the image the answer differs: the embeddings are what the model read.
    plain = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert plain[0].token_ids != want


def test_only_the_layers_before_the_feature_layer_are_loaded(loaded):
    # 3 CLIP layers read at -2: two run; the last layer and the post-LayerNorm are never used.
    assert len(loaded.vision.vision_model.layers) == 2
    params = sum(p.numel() for p in loaded.vision.parameters())
    assert params == loaded.vision.config.vision_parameters()


def test_capacity_reads_the_decoder_of_a_llava_folder(folder, loaded):
    from chatloom.models import describe_config

    cfg = describe_config(str(folder))
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (2, 2, 8, loaded.config.vocab_size)


@pytest.fixture(scope="module")
def gguf_pair(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("llava-gguf")
    return tl.write_gguf_pair(folder, out / "tiny-llava.gguf", out / "mmproj-tiny-llava.gguf")


def test_gguf_with_its_mmproj_gives_the_folders_tokens(hf, gguf_pair):
    from chatloom.models.vision.mmproj import attach_mmproj

    model_path, mmproj_path = gguf_pair
    loaded = load_model(str(model_path), "fp32")
    assert loaded.vision is None  # the decoder alone takes text only
    attach_mmproj(loaded, mmproj_path)
    assert len(loaded.vision.vision_model.layers) == 2
    image = tv.test_image(71, 47, seed=3)
    text = render_chat(loaded.tokenizer.chat_template, MESSAGES, add_generation_prompt=True)
    want_ids, want = hf_greedy(hf, text, image)
    ids, placed = tv.expand(loaded, text, [image])
    assert ids == want_ids
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=16))
    assert generate(engine, ids, placed) == want


def test_a_vocabulary_without_an_image_token_gets_placeholders(gguf_pair):
    from chatloom.models.vision.mmproj import attach_mmproj

    loaded = load_model(str(gguf_pair[0]), "fp32")
    attach_mmproj(loaded, gguf_pair[1])
    loaded.vision.image_token_in_vocab = False
    image = tv.test_image(40, 40)
    text = "USER: <image>\nhi ASSISTANT:"
    ids, placed = tv.expand(loaded, text, [image])
    first = loaded.tokenizer.encode("USER: ", add_special=True)
    assert ids[:len(first)] == first
    assert placed[0].positions == list(range(len(first), len(first) + 16))
    assert ids[len(first) + 16:] == loaded.tokenizer.encode("\nhi ASSISTANT:", add_special=False)


@pytest.mark.parametrize("problem", ["missing", "text-model", "wrong-width"])
def test_a_bad_projector_file_is_refused_by_name(gguf_pair, folder, tmp_path, problem):
    from chatloom.models import ModelError
    from chatloom.models.vision.mmproj import attach_mmproj

    loaded = load_model(str(gguf_pair[0]), "fp32")
    path = {"missing": tmp_path / "none.gguf", "text-model": gguf_pair[0], "wrong-width": gguf_pair[1]}[problem]
    if problem == "wrong-width":
        loaded.config.hidden_size = 64
    with pytest.raises(ModelError, match={"missing": "no such projector file", "text-model": "not a vision projector",
                                          "wrong-width": "does not fit the decoder"}[problem]):
        attach_mmproj(loaded, path)
    assert loaded.vision is None
