"""A tiny random-weight Idefics3 checkpoint built offline with transformers: config, weights,
tokenizer, image processor and chat template in one Hugging Face folder, as the hub ships SmolVLM."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# SmolVLM's own template, short: images as <image> markers in the user's turn.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SPECIALS = (["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
             "<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
TILE, PATCH, SCALE = 32, 8, 2  # 16 patches per tile, 4 image tokens per tile after the shuffle


def build_tokenizer() -> Tokenizer:
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def write_idefics3_folder(folder: Path, seed: int = 0, split: bool = True, vision_layers: int = 2) -> Path:
    """Write the checkpoint to `folder` and return it."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.idefics3 import Idefics3ImageProcessorPil, Idefics3Processor

    tok = build_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
                                   pad_token="<|endoftext|>")
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 4 * TILE}, max_image_size={"longest_edge": TILE},
                                                do_image_splitting=split)
    processor = Idefics3Processor(image_processor, fast, image_seq_len=(TILE // PATCH) ** 2 // SCALE ** 2,
                                  chat_template=CHAT_TEMPLATE)
    vocab = tok.get_vocab_size()
    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers, num_attention_heads=4,
                           image_size=TILE, patch_size=PATCH),
        text_config=dict(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         pad_token_id=tok.token_to_id("<|endoftext|>")),
        scale_factor=SCALE, image_token_id=tok.token_to_id("<image>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=tok.token_to_id("<end_of_utterance>"))
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # random weights large enough that the image changes the answer
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5 if "embed" not in name else 1.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_image(width: int = 71, height: int = 47, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels if channels > 1 else pixels[..., 0], mode)


# A user turn asking about one image, as both vision families' tests send it.
ONE_IMAGE_QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?"}]}]


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def expand(loaded, text: str, images: list[Image.Image]):
    """The prompt's token ids with each image's tokens in place, and where each image goes (as the server does)."""
    from chatloom.models.vision.images import content_hash
    from chatloom.models.vision.prompt import expand_images
    return expand_images(loaded.vision, loaded.tokenizer, text, [(content_hash(png(i)), i) for i in images])
