"""Whisper, an encoder-decoder speech recognizer, in PyTorch, loaded from a Hugging Face folder.

The encoder reads a 30-second window's log-mel features (two convolutions, then pre-norm transformer
layers); the decoder writes text tokens attending to its own tokens and to the encoder's output. A
batch of windows, from one request or many, is encoded together and decoded greedily in lockstep
with a key/value cache per layer (`transcribe`): each window's cross-attention keys and values are
computed once, each step adds one token's self-attention keys and values.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F

from chatloom.models.config import ModelError
from chatloom.models.tokenizer import TextTokenizer, from_hf_folder


@dataclass
class WhisperConfig:
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    encoder_ffn: int
    decoder_ffn: int
    vocab_size: int
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    max_target_positions: int = 448
    decoder_start_token_id: int = 50258
    eos_token_id: int = 50257
    suppress_tokens: list[int] = field(default_factory=list)
    begin_suppress_tokens: list[int] = field(default_factory=list)

    @classmethod
    def from_folder(cls, folder: Path) -> "WhisperConfig":
        try:
            cfg = json.loads((folder / "config.json").read_text())
            gen_path = folder / "generation_config.json"
            gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read the Whisper config in {folder}: {exc}") from None
        return cls.from_dict(cfg, gen, str(folder))

    @classmethod
    def from_dict(cls, cfg: dict, gen: dict | None = None, where: str = "config.json") -> "WhisperConfig":
        """From config.json's (and generation_config.json's) dictionaries."""
        gen = gen or {}
        try:
            if cfg.get("model_type") != "whisper":
                raise ModelError(f"{where} is not a Whisper checkpoint (model_type {cfg.get('model_type')!r})")
            if cfg.get("activation_function", "gelu") != "gelu" or cfg.get("scale_embedding"):
                raise ModelError("only Whisper's own gelu activation and unscaled embeddings are supported")
            return cls(d_model=int(cfg["d_model"]), encoder_layers=int(cfg["encoder_layers"]),
                       decoder_layers=int(cfg["decoder_layers"]),
                       encoder_heads=int(cfg["encoder_attention_heads"]),
                       decoder_heads=int(cfg["decoder_attention_heads"]),
                       encoder_ffn=int(cfg["encoder_ffn_dim"]), decoder_ffn=int(cfg["decoder_ffn_dim"]),
                       vocab_size=int(cfg["vocab_size"]), num_mel_bins=int(cfg.get("num_mel_bins", 80)),
                       max_source_positions=int(cfg.get("max_source_positions", 1500)),
                       max_target_positions=int(cfg.get("max_target_positions", 448)),
                       decoder_start_token_id=int(gen.get("decoder_start_token_id",
                                                          cfg.get("decoder_start_token_id", 50258))),
                       eos_token_id=int(gen.get("eos_token_id", cfg.get("eos_token_id", 50257))),
                       suppress_tokens=list(gen.get("suppress_tokens") or cfg.get("suppress_tokens") or []),
                       begin_suppress_tokens=list(gen.get("begin_suppress_tokens")
                                                  or cfg.get("begin_suppress_tokens") or []))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ModelError(f"the Whisper config in {where} lacks or has a bad {exc}") from None

    def num_parameters(self) -> int:
        d = self.d_model
        attn = 4 * d * d + 3 * d
        enc_layer = attn + 2 * d * self.encoder_ffn + self.encoder_ffn + d + 4 * d
        dec_layer = 2 * attn + 2 * d * self.decoder_ffn + self.decoder_ffn + d + 6 * d
        convs = self.num_mel_bins * d * 3 + d + d * d * 3 + d
        return (convs + self.max_source_positions * d + self.encoder_layers * enc_layer + 2 * d
                + self.vocab_size * d + self.max_target_positions * d + self.decoder_layers * dec_layer + 2 * d)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
        o = F.scaled_dot_product_attention(self.split(q), k, v, is_causal=causal)
        b, _, t, _ = o.shape
        return self.out_proj(o.transpose(1, 2).reshape(b, t, -1))

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.k_proj(x)), self.split(self.v_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = Attention(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn.attend(self.self_attn.q_proj(h), *self.self_attn.kv(h))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class DecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = Attention(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = Attention(d, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, cache: dict, start: int) -> torch.Tensor:
        """x [B, T, d]: tokens at positions start..start+T-1; cache holds this layer's keys and values."""
        h = self.self_attn_layer_norm(x)
        k, v = self.self_attn.kv(h)
        end = start + x.shape[1]
        cache["k"][:, :, start:end] = k
        cache["v"][:, :, start:end] = v
        keys, values = cache["k"][:, :, :end], cache["v"][:, :, :end]
        if x.shape[1] == 1:
            x = x + self.self_attn.attend(self.self_attn.q_proj(h), keys, values)
        else:  # the prompt: causal among its own tokens (start is 0)
            x = x + self.self_attn.attend(self.self_attn.q_proj(h), keys, values, causal=True)
        h = self.encoder_attn_layer_norm(x)
        x = x + self.encoder_attn.attend(self.encoder_attn.q_proj(h), cache["ck"], cache["cv"])
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class Encoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(EncoderLayer(d, cfg.encoder_heads, cfg.encoder_ffn) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).permute(0, 2, 1)
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class Decoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, d)
        self.layers = nn.ModuleList(DecoderLayer(d, cfg.decoder_heads, cfg.decoder_ffn) for _ in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, tokens: torch.Tensor, caches: list[dict], start: int) -> torch.Tensor:
        x = self.embed_tokens(tokens) + self.embed_positions.weight[start:start + tokens.shape[1]]
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache, start)
        return self.layer_norm(x)


class Whisper(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.decoder.embed_tokens.weight.T  # proj_out is tied to the embeddings

    @torch.inference_mode()
    def transcribe(self, features: torch.Tensor, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy text tokens for a batch of windows: features [B, mels, 3000], each with its prompt
        (start, language, task tokens; all the same length). Each list ends before end-of-text."""
        cfg = self.config
        batch, plen = len(prompts), len(prompts[0])
        if any(len(p) != plen for p in prompts):
            raise ValueError("the prompts of one batch must have the same length")
        max_new_tokens = min(max_new_tokens, cfg.max_target_positions - plen)
        encoded = self.encoder(features.to(self.decoder.embed_tokens.weight.dtype))
        total = plen + max_new_tokens
        caches = []
        for layer in self.decoder.layers:
            attn = layer.self_attn
            ck, cv = layer.encoder_attn.kv(encoded)
            shape = (batch, attn.heads, total, attn.head_dim)
            caches.append({"k": encoded.new_zeros(shape), "v": encoded.new_zeros(shape), "ck": ck, "cv": cv})
        suppress = torch.tensor(cfg.suppress_tokens, dtype=torch.long)
        begin = torch.tensor(cfg.begin_suppress_tokens, dtype=torch.long)
        tokens = torch.tensor(prompts, dtype=torch.long)
        out: list[list[int]] = [[] for _ in range(batch)]
        done = torch.zeros(batch, dtype=torch.bool)
        pos = 0
        for step in range(max_new_tokens):
            hidden = self.decoder(tokens, caches, pos)
            pos += tokens.shape[1]
            logits = self.logits(hidden[:, -1]).float()
            if len(suppress):
                logits[:, suppress] = -float("inf")
            if step == 0 and len(begin):
                logits[:, begin] = -float("inf")
            nxt = logits.argmax(dim=-1)
            for i in range(batch):
                if not done[i]:
                    if int(nxt[i]) == cfg.eos_token_id:
                        done[i] = True
                    else:
                        out[i].append(int(nxt[i]))
            if bool(done.all()):
                break
            tokens = nxt[:, None]
        return out


@dataclass
class LoadedWhisper:
    id: str
    model: Whisper
    tokenizer: TextTokenizer
    config: WhisperConfig

    def prompt(self, language: str | None) -> list[int]:
        """The decoder's first tokens: start of transcript, then (multilingual models) the language and
        the task, then no timestamps. ModelError for a language the model does not know."""
        tok = self.tokenizer.tokenizer
        ids = [self.config.decoder_start_token_id]
        if tok.token_to_id("<|en|>") is not None:  # multilingual
            lang = tok.token_to_id(f"<|{language or 'en'}|>")
            if lang is None:
                raise ModelError(f"the model does not know the language {language!r} (use a code such as en, fr)")
            ids += [lang, tok.token_to_id("<|transcribe|>")]
        elif language not in (None, "en"):
            raise ModelError(f"{self.id} transcribes English only")
        notimestamps = tok.token_to_id("<|notimestamps|>")
        return ids + ([notimestamps] if notimestamps is not None else [])


def is_whisper_folder(path: Path) -> bool:
    try:
        return path.is_dir() and json.loads((path / "config.json").read_text()).get("model_type") == "whisper"
    except (OSError, ValueError):
        return False


def load_whisper(folder: Path, dtype: torch.dtype = torch.float32) -> LoadedWhisper:
    from chatloom.models.hf_loader import read_weights

    folder = Path(folder)
    if not is_whisper_folder(folder):
        raise ModelError(f"{folder} is not a Whisper model folder (config.json with model_type whisper)")
    cfg = WhisperConfig.from_folder(folder)
    model = Whisper(cfg)
    weights = {k.removeprefix("model."): v.to(dtype) for k, v in read_weights(folder).items() if k != "proj_out.weight"}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ModelError(f"the Whisper weights do not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    tokenizer = from_hf_folder(folder, [cfg.eos_token_id])
    return LoadedWhisper(folder.name, model.eval().requires_grad_(False), tokenizer, cfg)
