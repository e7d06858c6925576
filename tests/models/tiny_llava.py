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


def write_gguf_pair(folder: Path, model_path: Path, mmproj_path: Path) -> tuple[Path, Path]:
    """The checkpoint in `folder` as llama.cpp splits LLaVA: the decoder as a GGUF text model (F32, Q/K
    rows permuted, the same vocabulary) and the encoder and projector as an `mmproj` GGUF (the layers
    before the feature layer only, no final LayerNorm, as llama.cpp's LLaVA converter writes it)."""
    import json

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    weights = load_file(str(folder / "model.safetensors"))
    decoder = {k[len("language_model."):]: v for k, v in weights.items() if k.startswith("language_model.")}
    write_decoder_gguf(model_path, "tiny-llava", text, decoder, build_tokenizer(), SPECIALS, "</s>", CHAT_TEMPLATE)

    keep = vision["num_hidden_layers"] + 1 + cfg["vision_feature_layer"]  # layers before the feature layer
    p = gguf.GGUFWriter(str(mmproj_path), "clip")
    p.add_bool("clip.has_text_encoder", False)
    p.add_bool("clip.has_vision_encoder", True)
    p.add_bool("clip.has_llava_projector", True)
    p.add_string("clip.projector_type", "mlp")
    p.add_uint32("clip.vision.image_size", vision["image_size"])
    p.add_uint32("clip.vision.patch_size", vision["patch_size"])
    p.add_uint32("clip.vision.embedding_length", vision["hidden_size"])
    p.add_uint32("clip.vision.feed_forward_length", vision["intermediate_size"])
    p.add_uint32("clip.vision.projection_dim", vision["projection_dim"])
    p.add_uint32("clip.vision.attention.head_count", vision["num_attention_heads"])
    p.add_float32("clip.vision.attention.layer_norm_epsilon", vision["layer_norm_eps"])
    p.add_uint32("clip.vision.block_count", keep)
    p.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    p.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    p.add_bool("clip.use_gelu", vision["hidden_act"] == "gelu")
    blk = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
           "mlp.fc2": "ffn_down"}
    for name, t in weights.items():
        if name.startswith("multi_modal_projector."):
            layer, kind = name.split(".")[1:]
            gname = f"mm.{0 if layer == 'linear_1' else 2}.{kind}"
        elif name.startswith("vision_tower."):
            rest = name[len("vision_tower."):]
            if rest.startswith("encoder.layers."):
                parts = rest.split(".")
                if int(parts[2]) >= keep:
                    continue
                gname = f"v.blk.{parts[2]}.{blk['.'.join(parts[3:-1])]}.{parts[-1]}"
            else:
                gname = {"embeddings.class_embedding": "v.class_embd",
                         "embeddings.patch_embedding.weight": "v.patch_embd.weight",
                         "embeddings.position_embedding.weight": "v.position_embd.weight",
                         "pre_layrnorm.weight": "v.pre_ln.weight", "pre_layrnorm.bias": "v.pre_ln.bias"}.get(rest)
                if gname is None:  # the final LayerNorm: not written for LLaVA
                    continue
        else:
            continue
        p.add_tensor(gname, np.ascontiguousarray(t.numpy(), dtype=np.float32))
    p.write_header_to_file()
    p.write_kv_data_to_file()
    p.write_tensors_to_file()
    p.close()
    return model_path, mmproj_path


def write_decoder_gguf(path: Path, name: str, text: dict, decoder: dict[str, torch.Tensor], tok: Tokenizer,
                       specials: list[str], eos: str, chat_template: str) -> Path:
    """A vision model's Llama decoder as llama.cpp's converter writes it: a GGUF text model (F32, Q/K rows
    permuted) with the same vocabulary, its special tokens as control tokens. `decoder` holds the
    Hugging Face names under model.* and lm_head."""
    import gguf
    import numpy as np

    import tiny_checkpoints as tc

    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(text["max_position_embeddings"])
    w.add_embedding_length(text["hidden_size"])
    w.add_block_count(text["num_hidden_layers"])
    w.add_feed_forward_length(text["intermediate_size"])
    w.add_head_count(text["num_attention_heads"])
    w.add_head_count_kv(text["num_key_value_heads"])
    w.add_layer_norm_rms_eps(text["rms_norm_eps"])
    w.add_rope_freq_base(text["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(text["head_dim"])
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([])
    w.add_eos_token_id(tokens.index(eos))
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)
    for hf_name, t in decoder.items():
        if hf_name in tc._GGUF_GLOBAL:
            gname = tc._GGUF_GLOBAL[hf_name]
        else:
            parts = hf_name.split(".")
            gname = f"blk.{parts[2]}.{tc._GGUF_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
        arr = t.numpy()
        if gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = text["num_attention_heads"] if "attn_q" in gname else text["num_key_value_heads"]
            arr = tc.permute_for_gguf(t, heads)
        w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
