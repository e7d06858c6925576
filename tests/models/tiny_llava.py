"""A tiny random-weight LLaVA-1.5-shaped checkpoint built offline with transformers: a CLIP vision tower
read at its second-to-last layer, a two-layer GELU projector and a Llama decoder, with its tokenizer,
CLIP image processor and chat template, in one Hugging Face folder as the hub ships llava-1.5."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% if message['role'] != 'user' %}</s>{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<image>", "<pad>"]
IMAGE, PATCH = 32, 8  # 16 patches: 16 image tokens per image


def build_tokenizer() -> Tokenizer:
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def hf_config(vocab: int, image_token: int, **overrides):
    from transformers import LlavaConfig

    return LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=4, image_size=IMAGE, patch_size=PATCH,
                           projection_dim=16),
        text_config=dict(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False),
        image_token_index=image_token, vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_seq_length=(IMAGE // PATCH) ** 2, **overrides)


def write_llava_folder(folder: Path, seed: int = 0, pad: bool = False) -> Path:
    """Write the checkpoint to `folder` and return it."""
    from transformers import LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.llava import LlavaImageProcessorPil

    tok = build_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    images = LlavaImageProcessorPil(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE},
                                    do_pad=pad)
    processor = LlavaProcessor(images, fast, patch_size=PATCH, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    config = hf_config(tok.get_vocab_size(), tok.token_to_id("<image>"))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # random weights large enough that the image changes the answer
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5 if "embed" not in name else 1.0)
            elif "class_embedding" in name or "bias" in name:
                p.normal_(0.0, 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
