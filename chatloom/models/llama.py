"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a flat token batch."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from chatloom.models.attention import AttentionBatch, paged_attention
from chatloom.models.config import ModelConfig
from chatloom.models.kernels import load_kernels
from chatloom.models.packed_linear import KernelLinear


_LOGIT_SLICE = 2048


def fused_kernels(x: torch.Tensor):
    """The C++ layer kernels when they apply to x (float32 and built), else None."""
    if x.dtype != torch.float32:
        return None
    kernels = load_kernels()
    return kernels if kernels is not None and hasattr(kernels, "add_rms_norm") else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """rms_norm(x); with `residual`, first residual += x (in place), then rms_norm(residual)."""
        kernels = fused_kernels(x)
        if residual is None:
            if kernels is not None and x.dim() == 2:
                return kernels.rms_norm(x.contiguous(), self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if kernels is not None:
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        residual.add_(x)
        return F.rms_norm(residual, (residual.shape[-1],), self.weight, self.eps)


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
        kernels = fused_kernels(xs[0])
        if kernels is not None and len(xs) == 2:
            return kernels.rotary(xs[0], xs[1], positions, self.cos, self.sin, self.interleaved)
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
        qkv = self.qkv_proj(x)  # [T, q + 2kv]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=1)
        q = q.view(-1, self.hq, self.d)
        k = k.view(-1, self.hkv, self.d)
        v = v.view(-1, self.hkv, self.d)
        q, k = rope(positions, q, k)
        o = paged_attention(q, k, v, cache, batch)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        kernels = fused_kernels(gate_up)
        if kernels is not None:
            return self.down_proj(kernels.silu_and_mul(gate_up))
        return self.down_proj(F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter:])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: RotaryEmbedding, cache, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output; residual: the running sum before it (None at
        the first layer, where x is the embedding). Returns this layer's MLP output and
        the residual stream without it, so the next norm can add and normalize in one pass."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, cache, batch)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


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
        x = self.embed_tokens(input_ids)  # a fresh tensor: the residual stream may be updated in place
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rope, kv_caches[i] if kv_caches else None, batch)
        return self.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (bf16 logits would round near-ties into exact ties)."""
        return self.logits_and_argmax(hidden, want_argmax=False)[0]

    def logits_and_argmax(self, hidden: torch.Tensor, want_argmax: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [N, vocab] and, if asked, each row's argmax [N].

        Without the packed kernel, the head runs as W @ hidden^T (the faster BLAS shape
        here) in vocabulary slices that stay in cache; each slice's maximum is taken while
        it is still there, far cheaper than an argmax down the columns of [vocab, N]."""
        if isinstance(self.lm_head, KernelLinear):
            logits = self.lm_head(hidden)
            return logits, logits.argmax(dim=-1) if want_argmax else None
        w = self.lm_head.weight
        if w.dtype == torch.bfloat16 or w.dtype == torch.float16:
            logits = F.linear(hidden.float(), w.float())
            return logits, logits.argmax(dim=-1) if want_argmax else None
        out = torch.empty(w.shape[0], hidden.shape[0], dtype=hidden.dtype)
        ht = hidden.t().contiguous()
        best_val = best_idx = None
        for start in range(0, w.shape[0], _LOGIT_SLICE):
            piece = out[start:start + _LOGIT_SLICE]
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
