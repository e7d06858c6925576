"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a flat token batch."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from chatloom.models.attention import AttentionBatch, paged_attention
from chatloom.models.config import ModelConfig
from chatloom.models.kernels import load_kernels


# Below this many rows, W @ x.T beats x @ W.T on CPU BLAS (no repacking of the weight
# per call); decode batches live here, long prefill chunks above it.
_SMALL_BATCH = 256
_LOGIT_SLICE = 2048


# Up to this many rows, our AVX2 kernel beats MKL's GEMM by 2-6x (bench roofline shows
# MKL at 13-17 GFLOP/s for 1-8 rows on AMD CPUs); from about 16 rows on, MKL wins.
_SKINNY_MAX_ROWS = 12


def matmul_wx(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w [N, K] @ x [T, K]^T -> [N, T], contiguous."""
    if x.shape[0] <= _SKINNY_MAX_ROWS and x.dtype == torch.float32:
        kernels = load_kernels()
        if kernels is not None:
            return kernels.skinny_matmul(w, x.contiguous())
    return torch.mm(w, x.t())


def linear_t(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(x), returned transposed: [out_features, T] (contiguous for small T)."""
    if x.shape[0] <= _SMALL_BATCH:
        y = matmul_wx(layer.weight, x)
    else:
        y = F.linear(x, layer.weight).t()
    if layer.bias is not None:
        y = y + layer.bias.unsqueeze(1)
    return y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        t = torch.arange(cfg.max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        self.interleaved = cfg.rope_interleaved
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Rotate each x: [T, H, D] at `positions` [T]."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        out = []
        for x in xs:
            c, s = cos.to(x.dtype), sin.to(x.dtype)
            if self.interleaved:
                x1, x2 = x[..., 0::2], x[..., 1::2]
                out.append(torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2))
            else:
                x1, x2 = x.chunk(2, dim=-1)
                out.append(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.hq * self.d, self.hkv * self.d
        # One fused projection: one matmul per layer instead of three.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                cache: tuple[torch.Tensor, torch.Tensor] | None, batch: AttentionBatch) -> torch.Tensor:
        qkv = linear_t(x, self.qkv_proj)  # [q + 2kv, T]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=0)
        q = q.t().reshape(-1, self.hq, self.d)
        k = k.t().reshape(-1, self.hkv, self.d)
        v = v.t().reshape(-1, self.hkv, self.d)
        q, k = rope(positions, q, k)
        o = paged_attention(q, k, v, cache, batch)
        return linear_t(o.flatten(1), self.o_proj).t()


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Stay in the transposed layout between the two matmuls: no copies.
        gate_up = linear_t(x, self.gate_up_proj)  # [2I, T]
        h = F.silu(gate_up[: self.inter]) * gate_up[self.inter:]
        if x.shape[0] <= _SMALL_BATCH:
            return matmul_wx(self.down_proj.weight, h.t()).t()
        return F.linear(h.t(), self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rope, cache, batch):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rope, kv_caches[i] if kv_caches else None, batch)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (bf16 logits would round near-ties into exact ties)."""
        return self.logits_and_argmax(hidden, want_argmax=False)[0]

    def logits_and_argmax(self, hidden: torch.Tensor, want_argmax: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [N, vocab] (a transposed view) and, if asked, each row's argmax [N].

        The vocabulary is done in slices that stay in cache; each slice's maximum is
        taken while it is still there, which is far cheaper than an argmax over the
        finished [N, vocab] matrix."""
        w = self.lm_head.weight
        if w.dtype == torch.bfloat16 or w.dtype == torch.float16:
            logits = F.linear(hidden.float(), w.float())
            return logits, logits.argmax(dim=-1) if want_argmax else None
        out = torch.empty(w.shape[0], hidden.shape[0], dtype=hidden.dtype)
        ht = hidden.t().contiguous()
        skinny = hidden.shape[0] <= _SKINNY_MAX_ROWS
        best_val = best_idx = None
        for start in range(0, w.shape[0], _LOGIT_SLICE):
            piece = out[start:start + _LOGIT_SLICE]
            if skinny:
                piece.copy_(matmul_wx(w[start:start + _LOGIT_SLICE], hidden))
            else:
                torch.mm(w[start:start + _LOGIT_SLICE], ht, out=piece)
            if want_argmax:
                val, idx = piece.max(dim=0)
                if best_val is None:
                    best_val, best_idx = val, idx
                else:
                    better = val > best_val  # strict: ties keep the lower id, like argmax
                    best_val = torch.where(better, val, best_val)
                    best_idx = torch.where(better, idx + start, best_idx)
        return out.t(), best_idx

    @torch.inference_mode()
    def dense_logits(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Logits for every position of each sequence, without any cache (the reference path)."""
        lens = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        pos = torch.cat([torch.arange(n) for n in lens])
        logits = self.compute_logits(self(ids, pos, AttentionBatch.dense(lens)))
        return list(logits.split(lens))
