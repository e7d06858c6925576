"""A LLaVA served from a GGUF decoder and its llama.cpp projector file (`--mmproj`): the backend loads
both, /v1/models says it takes images, and an image through the chat API gives the Hugging Face
folder's own greedy answer."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from chatloom.engine import EngineConfig
from chatloom.models import ModelError
from chatloom.serving import LocalBackend

from app_testing import app_client
from test_vision_api import TEXT, ask, data_url, image_part, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import tiny_llava as tl  # noqa: E402
import tiny_vision as tv  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("llava-serving")
    folder = tl.write_llava_folder(out / "tiny-llava")
    return folder, *tl.write_gguf_pair(folder, out / "tiny-llava.gguf", out / "mmproj.gguf")


async def test_a_gguf_decoder_with_its_mmproj_answers_about_an_image(tmp_path, pair):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    folder, model_path, mmproj = pair
    backend = LocalBackend(str(model_path), engine_config=EngineConfig(num_blocks=64), mmproj=str(mmproj))
    backend.check()
    await backend.start()
    try:
        image = tv.test_image(71, 47, seed=5)
        async with app_client(settings(tmp_path), backend) as (client, _, headers):
            models = await client.get("/v1/models", headers=headers)
            assert models.json()["data"][0]["capabilities"]["vision"] is True
            r = await client.post("/v1/chat/completions", headers=headers,
                                  json=ask(image_part(data_url(image)), TEXT, model="tiny-llava"))
            assert r.status_code == 200, r.text
        processor = AutoProcessor.from_pretrained(folder)
        model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
        text = processor.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": TEXT["text"]}]}], add_generation_prompt=True)
        inputs = processor(text=text, images=[image], return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        want = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
        assert r.json()["choices"][0]["message"]["content"] == want
    finally:
        await backend.close()


def test_a_missing_projector_file_is_refused_before_loading(pair, tmp_path):
    backend = LocalBackend(str(pair[1]), mmproj=str(tmp_path / "absent.gguf"))
    with pytest.raises(ModelError, match="no such projector file"):
        backend.check()
    asyncio.run(backend.close())
