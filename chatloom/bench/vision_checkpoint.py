"""A random-weight checkpoint of SmolVLM-256M's shape (Idefics3: a SigLIP encoder, the pixel-shuffle
connector and a Llama decoder), made offline, for `chatloom bench vision` at the real size.

The config is chatloom/examples/smolvlm-256m.json (the published one); the weights are seeded
N(0, WEIGHT_STD) with norms at 1 and biases at 0, as in chatloom.bench.checkpoints. The tokenizer is
the bundled SmolLM2 GGUF's 49,152 tokens followed by SmolVLM's 128 added tokens at their published
ids (<global-img> 49152, <row_R_col_C> 49153-49188, <fake_token_around_image> 49189, <image> 49190,
<end_of_utterance> 49279, the rest unused). The image processor has SmolVLM-256M's published
settings: the longest edge scaled to 2048, 512-pixel tiles, splitting on, 64 tokens a tile.
The folder is written by transformers' own Idefics3 classes, so it is what the hub ships.
"""
from __future__ import annotations

import copy
import json
import math
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from chatloom.bench.checkpoints import WEIGHT_STD, CheckpointError, tokenizer_metadata, Shape

NAME = "smolvlm-256m"
_BASE_VOCAB = 49152
# SmolVLM's template: images as <image> markers in the user's turn, "User:"/"Assistant:" roles.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def published_config() -> dict[str, Any]:
    """SmolVLM-256M's config.json as chatloom ships it in its examples."""
    text = resources.files("chatloom").joinpath("examples/smolvlm-256m.json").read_text()
    return json.loads(text)


def added_tokens(count: int = 128) -> list[str]:
    """SmolVLM's added tokens in id order, from 49152 on."""
    grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokens = ["<global-img>", *grid, "<fake_token_around_image>", "<image>"]
    tokens += [f"<|reserved_{i}|>" for i in range(len(tokens), count - 1)]
    return tokens + ["<end_of_utterance>"]


def _tokenizer(vocab: int) -> Any:
    """The SmolLM2 tokenizer with SmolVLM's added tokens, as a transformers fast tokenizer."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from chatloom.models.tokenizer import from_gguf

    meta = tokenizer_metadata(Shape("smollm2", {"vocab_size": _BASE_VOCAB, "model_type": "llama"}, "smollm2"))
    tok = from_gguf(SimpleNamespace(metadata=meta)).tokenizer
    extra = added_tokens(vocab - _BASE_VOCAB)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    for i, t in enumerate(extra):
        if tok.token_to_id(t) != _BASE_VOCAB + i:
            raise CheckpointError(f"{NAME}: token {t!r} did not land at id {_BASE_VOCAB + i}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every matrix (and the embeddings) N(0, WEIGHT_STD), layer-norm weights 1, biases 0, seeded."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * WEIGHT_STD)


def make_vision_checkpoint(out_dir: Path, seed: int = 0, config: dict[str, Any] | None = None,
                           longest_edge: int = 2048) -> tuple[Path, int]:
    """Write NAME-hf/ under out_dir; return the folder and the parameter count. `config` (the
    published one by default) and `longest_edge` let tests write the same thing small."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3 import Idefics3ImageProcessorPil, Idefics3Processor

    cfg = copy.deepcopy(config or published_config())
    text, vision = cfg["text_config"], cfg["vision_config"]
    fast = _tokenizer(text["vocab_size"])
    image_id = fast.convert_tokens_to_ids("<image>")
    if image_id != cfg["image_token_id"]:
        raise CheckpointError(f"{NAME}: <image> is id {image_id}, the config says {cfg['image_token_id']}")
    tile = vision["image_size"]
    image_seq_len = (tile // vision["patch_size"]) ** 2 // cfg["scale_factor"] ** 2
    processor = Idefics3Processor(
        Idefics3ImageProcessorPil(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile},
                               do_image_splitting=True),
        fast, image_seq_len=image_seq_len, chat_template=CHAT_TEMPLATE)
    eos, pad = fast.convert_tokens_to_ids("<end_of_utterance>"), fast.convert_tokens_to_ids("<|im_end|>")
    hf = Idefics3Config(vision_config=vision, text_config=dict(text, pad_token_id=pad),
                        scale_factor=cfg["scale_factor"], image_token_id=image_id, pad_token_id=pad,
                        eos_token_id=eos, bos_token_id=fast.bos_token_id)
    model = Idefics3ForConditionalGeneration(hf).eval()
    _randomize(model, seed)
    folder = Path(out_dir) / f"{NAME}-hf"
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    processor.save_pretrained(folder)
    params = sum(math.prod(p.shape) for p in model.parameters())
    return folder, params
