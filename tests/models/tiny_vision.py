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


_SIGLIP_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
                 "mlp.fc2": "ffn_down"}


def _mmproj_name(name: str) -> str | None:
    """The projector file's name for an Idefics3 checkpoint's vision or connector weight (None: the decoder's)."""
    if name == "model.connector.modality_projection.proj.weight":
        return "mm.model.fc.weight"
    prefix = "model.vision_model."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    if rest.startswith("encoder.layers."):
        parts = rest.split(".")
        return f"v.blk.{parts[2]}.{_SIGLIP_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
    return {"embeddings.patch_embedding.weight": "v.patch_embd.weight",
            "embeddings.patch_embedding.bias": "v.patch_embd.bias",
            "embeddings.position_embedding.weight": "v.position_embd.weight",
            "post_layernorm.weight": "v.post_ln.weight", "post_layernorm.bias": "v.post_ln.bias"}[rest]


def write_idefics3_gguf_pair(folder: Path, model_path: Path, mmproj_path: Path, longest_edge: bool = True,
                             edit: dict | None = None) -> tuple[Path, Path]:
    """The checkpoint in `folder` as llama.cpp splits SmolVLM: the decoder as a GGUF text model (the same
    vocabulary, image tokens included) and the SigLIP encoder and connector as an `mmproj` GGUF with
    clip.projector_type idefics3, the scale factor and the processor's longest edge, as llama.cpp's
    converter writes them. `longest_edge` False leaves clip.vision.preproc_image_size out; `edit` maps
    projector tensor names to an array to write instead, or to None to leave the tensor out."""
    import json

    import gguf
    from safetensors.torch import load_file

    from tiny_llava import write_decoder_gguf

    cfg = json.loads((folder / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    processor = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    weights = load_file(str(folder / "model.safetensors"))
    decoder = {("model." + k[len("model.text_model."):] if k.startswith("model.text_model.") else k): v
               for k, v in weights.items() if _mmproj_name(k) is None}
    write_decoder_gguf(model_path, "tiny-smolvlm", text, decoder, build_tokenizer(), SPECIALS, "<end_of_utterance>",
                       CHAT_TEMPLATE)

    p = gguf.GGUFWriter(str(mmproj_path), "clip")
    p.add_bool("clip.has_vision_encoder", True)
    p.add_string("clip.projector_type", "idefics3")
    p.add_uint32("clip.vision.projection_dim", text["hidden_size"])
    p.add_uint32("clip.vision.image_size", vision["image_size"])
    p.add_uint32("clip.vision.patch_size", vision["patch_size"])
    p.add_uint32("clip.vision.embedding_length", vision["hidden_size"])
    p.add_uint32("clip.vision.feed_forward_length", vision["intermediate_size"])
    p.add_uint32("clip.vision.block_count", vision["num_hidden_layers"])
    p.add_uint32("clip.vision.attention.head_count", vision["num_attention_heads"])
    p.add_float32("clip.vision.attention.layer_norm_epsilon", vision["layer_norm_eps"])
    p.add_array("clip.vision.image_mean", processor["image_mean"])
    p.add_array("clip.vision.image_std", processor["image_std"])
    p.add_uint32("clip.vision.projector.scale_factor", cfg["scale_factor"])
    p.add_bool("clip.use_gelu", True)
    if longest_edge:
        p.add_uint32("clip.vision.preproc_image_size", processor["size"]["longest_edge"])
    edit = edit or {}
    for name, t in weights.items():
        gname = _mmproj_name(name)
        if gname is None:
            continue
        arr = edit.get(gname, t.numpy())
        if arr is not None:
            p.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    p.write_header_to_file()
    p.write_kv_data_to_file()
    p.write_tensors_to_file()
    p.close()
    return model_path, mmproj_path
