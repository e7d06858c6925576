"""Idefics3 / SmolVLM through chatloom against transformers, on a tiny random checkpoint built offline:
the same pixel values, the same prompt tokens, the same image embeddings and the same greedy tokens."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models import load_model
from chatloom.models.chat_template import render_chat

import tiny_vision as tv

MESSAGES = tv.ONE_IMAGE_QUESTION


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tv.write_idefics3_folder(tmp_path_factory.mktemp("idefics3") / "tiny-idefics3")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration
    return Idefics3ForConditionalGeneration.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def loaded(folder):
    return load_model(str(folder), "fp32")


@pytest.mark.parametrize("size,mode", [((71, 47), "RGB"), ((20, 90), "RGB"), ((16, 16), "RGB"),
                                       ((300, 129), "RGBA"), ((64, 64), "L"), ((33, 200), "P")])
def test_pixel_values_match_the_processor(hf, loaded, size, mode):
    image = tv.test_image(*size, mode="RGB" if mode == "P" else mode)
    if mode == "P":
        image = image.convert("P")
    want = hf[1].image_processor(images=[image], return_tensors="np", return_row_col_info=True)
    ours = loaded.vision.processor(image)
    tiles = want["pixel_values"][0]
    assert ours.pixel_values.shape == tiles.shape
    np.testing.assert_allclose(ours.pixel_values, tiles, atol=1e-5, rtol=0)
    assert (ours.rows, ours.cols) == (want["rows"][0][0], want["cols"][0][0])
    assert loaded.vision.processor.grid(*size) == (ours.rows, ours.cols)


def test_prompt_tokens_match_the_processor(hf, loaded):
    model, processor = hf
    images = [tv.test_image(71, 47, seed=1), tv.test_image(20, 20, seed=2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                             {"type": "image"}, {"type": "text", "text": "?"}]}]
    text = render_chat(loaded.tokenizer.chat_template, messages)
    want = processor(text=text, images=images, return_tensors="pt")["input_ids"][0].tolist()
    ids, placed = tv.expand(loaded, text, images)
    assert ids == want
    image_token = loaded.vision.image_token_id
    assert [p for image in placed for p in image.positions] == [i for i, t in enumerate(ids) if t == image_token]
    # 71 x 47 is resized to 128 x 84, then to 3 x 4 tiles of 32 (and a global view); 20 x 20 to 4 x 4 tiles.
    assert [i.num_tokens for i in placed] == [(3 * 4 + 1) * 4, (4 * 4 + 1) * 4]


def test_image_embeddings_match_transformers(hf, loaded):
    model, processor = hf
    image = tv.test_image(71, 47)
    inputs = processor(text="<image>", images=[image], return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output[0]
    got = loaded.vision.encode(loaded.vision.preprocess(image))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("size", [(71, 47), (24, 24)])
def test_greedy_tokens_match_transformers(hf, loaded, size):
    model, processor = hf
    image = tv.test_image(*size, seed=3)
    text = render_chat(loaded.tokenizer.chat_template, MESSAGES)
    inputs = processor(text=text, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = out[0, inputs["input_ids"].shape[1]:].tolist()

    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=16))
    ids, placed = tv.expand(loaded, text, [image])
    assert ids == inputs["input_ids"][0].tolist()
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), images=placed)
    got = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                got = o.token_ids
    assert got == want
    # Without the image the answer differs: the embeddings are what the model read.
    plain = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert plain[0].token_ids != want


def test_capacity_reads_the_decoder_of_a_vision_folder_or_its_config(folder, loaded):
    from chatloom.models import describe_config

    for spec in (folder, folder / "config.json"):
        cfg = describe_config(str(spec))
        assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (2, 2, 8, loaded.config.vocab_size)
        assert cfg.kv_bytes_per_token() == 2 * 2 * 2 * 8 * 4


@pytest.fixture(scope="module")
def gguf_pair(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("idefics3-gguf")
    return tv.write_idefics3_gguf_pair(folder, out / "tiny-smolvlm.gguf", out / "mmproj-tiny-smolvlm.gguf")


@pytest.fixture(scope="module")
def from_gguf(gguf_pair):
    from chatloom.models.vision.mmproj import attach_mmproj

    model_path, mmproj_path = gguf_pair
    loaded = load_model(str(model_path), "fp32")
    assert loaded.vision is None  # the decoder alone takes text only
    attach_mmproj(loaded, mmproj_path)
    return loaded


def greedy(loaded, ids: list[int], placed, n: int = 12) -> list[int]:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=16))
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), images=placed)
    got = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                got = o.token_ids
    return got


@pytest.mark.parametrize("size", [(71, 47), (24, 24)])
def test_gguf_with_its_mmproj_gives_the_folders_tokens(loaded, from_gguf, size):
    image = tv.test_image(*size, seed=3)
    text = render_chat(from_gguf.tokenizer.chat_template, MESSAGES)
    want_ids, want_placed = tv.expand(loaded, text, [image])
    ids, placed = tv.expand(from_gguf, text, [image])
    assert ids == want_ids  # the image tokens come from the GGUF decoder's own vocabulary
    assert [i.positions for i in placed] == [i.positions for i in want_placed]
    want = greedy(loaded, want_ids, want_placed)
    assert greedy(from_gguf, ids, placed) == want
    # Without the image the answer differs: the embeddings are what the model read.
    assert greedy(from_gguf, ids, None) != want


def test_the_projector_file_gives_the_folders_image_settings(loaded, from_gguf):
    ours, theirs = from_gguf.vision, loaded.vision
    assert ours.processor == theirs.processor
    eps = theirs.config.vision.layer_norm_eps
    assert ours.config.vision.layer_norm_eps == pytest.approx(eps)  # stored as a float32
    assert (ours.config.scale_factor, replace(ours.config.vision, layer_norm_eps=eps), ours.image_token_id) == \
        (theirs.config.scale_factor, theirs.config.vision, theirs.image_token_id)
    image = tv.test_image(71, 47)
    torch.testing.assert_close(ours.encode(ours.preprocess(image)), theirs.encode(theirs.preprocess(image)))


def test_without_a_longest_edge_an_image_is_one_tile(folder, tmp_path):
    from chatloom.models.vision.mmproj import attach_mmproj

    model_path, mmproj_path = tv.write_idefics3_gguf_pair(folder, tmp_path / "m.gguf", tmp_path / "p.gguf",
                                                          longest_edge=False)
    loaded = load_model(str(model_path), "fp32")
    attach_mmproj(loaded, mmproj_path)
    assert loaded.vision.processor.longest_edge == loaded.vision.processor.tile == tv.TILE
    assert loaded.vision.num_image_tokens(300, 129) == loaded.vision.config.image_seq_len


@pytest.fixture(scope="module")
def llava_pair(tmp_path_factory):
    import tiny_llava as tl

    out = tmp_path_factory.mktemp("llava-for-idefics3")
    folder = tl.write_llava_folder(out / "tiny-llava")
    return tl.write_gguf_pair(folder, out / "tiny-llava.gguf", out / "mmproj-tiny-llava.gguf")


@pytest.mark.parametrize("problem", ["llava-projector", "llava-decoder", "missing-tensor", "wrong-shape",
                                     "wrong-width", "projector-type"])
def test_a_bad_projector_file_is_refused_by_name(folder, gguf_pair, llava_pair, tmp_path, problem):
    import gguf

    from chatloom.models import ModelError
    from chatloom.models.vision.mmproj import attach_mmproj

    model_path, mmproj_path = gguf_pair
    match = {"llava-projector": "a LLaVA \\(mlp\\) projector, but the decoder's vocabulary has Idefics3's",
             "llava-decoder": "an Idefics3 \\(SmolVLM\\) projector, but the decoder's vocabulary lacks "
                              "<fake_token_around_image>",
             "missing-tensor": "weight 'v.post_ln.weight' is missing",
             "wrong-shape": r"weight mm.model.fc.weight has shape \(32, 64\), expected \(32, 128\)",
             "wrong-width": "does not fit the decoder",
             "projector-type": "projector type 'ldp' in p.gguf is not supported"}[problem]
    if problem == "llava-projector":
        mmproj_path = llava_pair[1]
    elif problem == "llava-decoder":
        model_path = llava_pair[0]
    elif problem in ("missing-tensor", "wrong-shape", "wrong-width"):
        edit = {"missing-tensor": {"v.post_ln.weight": None},
                "wrong-shape": {"mm.model.fc.weight": np.zeros((32, 64), np.float32)},
                "wrong-width": {"mm.model.fc.weight": np.zeros((48, 128), np.float32)}}[problem]
        _, mmproj_path = tv.write_idefics3_gguf_pair(folder, tmp_path / "m.gguf", tmp_path / "p.gguf", edit=edit)
    else:  # the same file under a projector type chatloom does not read
        reader = gguf.GGUFReader(str(mmproj_path))
        w = gguf.GGUFWriter(str(tmp_path / "p.gguf"), "clip")
        for key, f in reader.fields.items():
            if key.startswith("clip."):
                value = "ldp" if key == "clip.projector_type" else f.contents()
                w.add_key_value(key, value, f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        mmproj_path = tmp_path / "p.gguf"
    loaded = load_model(str(model_path), "fp32")
    with pytest.raises(ModelError, match=match):
        attach_mmproj(loaded, mmproj_path)
    assert loaded.vision is None
