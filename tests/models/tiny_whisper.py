"""A tiny random-weight Whisper checkpoint built offline with transformers (config, weights, a byte-level
tokenizer with Whisper's special tokens, the feature extractor's settings), and test audio."""
from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|transcribe|>", "<|translate|>",
            "<|notimestamps|>"]


def build_tokenizer() -> Tokenizer:
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def write_whisper_folder(folder: Path, seed: int = 0) -> Path:
    from transformers import PreTrainedTokenizerFast, WhisperConfig, WhisperFeatureExtractor
    from transformers import WhisperForConditionalGeneration

    tok = build_tokenizer()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    config = WhisperConfig(vocab_size=tok.get_vocab_size(), d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, num_mel_bins=80, max_source_positions=1500, max_target_positions=64,
                           decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids["<|endoftext|>"],
                           pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"],
                           suppress_tokens=[ids["<|translate|>"]], begin_suppress_tokens=[ids["<|endoftext|>"], 32])
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # weights large enough that the audio and the position change the tokens
        for name, p in model.named_parameters():
            if name.endswith("decoder.embed_positions.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 0.5)
            elif p.dim() >= 2 and "embed_positions" not in name:
                p.normal_(0.0, 2 * p.shape[-1] ** -0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    return folder


def wav_bytes(seconds: float, rate: int = 8000, channels: int = 2, seed: int = 0) -> bytes:
    """A WAV file of tones and noise (not 16 kHz mono, so decoding must resample and mix down)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    signal = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * (200 + 50 * seed) * t)
    signal = signal + 0.05 * rng.standard_normal(t.size)
    pcm = (np.clip(signal, -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(pcm[:, None], channels, axis=1).tobytes())
    return buf.getvalue()
