"""One configurable decoder for every supported family, over a flat token batch.

The Llama block (RMSNorm, RoPE, GQA, SwiGLU) is the base; ModelConfig's switches add what
the others need: query/key norms (Qwen3, Gemma 3), Gemma's sandwich norms, GELU, embedding
scaling, soft-capping and per-layer sliding windows, and mixture-of-experts feed-forward
layers (Mixtral, Qwen MoE). One definition keeps the fused paths (QKV, gate/up, the C++
kernels) shared by all of them.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from chatloom.models.attention import AttentionBatch, paged_attention
from chatloom.models.config import ModelConfig, RopeScaling
from chatloom.models.kernels import load_kernels
from chatloom.models.moe import SparseMoE
from chatloom.models.packed_linear import KernelLinear, QuantizedLinear
from chatloom.models.quantized_embedding import QuantizedEmbedding
from chatloom.models.rope import rope_tables


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
    """cos/sin tables for every position the model serves (rope.py builds them for each
    scaling type); the rotation itself is the same for all of them."""

    def __init__(self, cfg: ModelConfig, theta: float | None = None, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta if theta is None else theta,
                               cfg.rope_scaling if scaling is None else scaling,
                               cfg.rope_trained_max_position or cfg.max_position, cfg.max_position)
        self.interleaved = cfg.rope_interleaved
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

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


def head_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dimension of x [T, H, D] (Qwen3 / Gemma 3 query-key norms)."""
    t, h, d = x.shape
    return norm(x.reshape(t * h, d)).view(t, h, d)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.hq * self.d, self.hkv * self.d
        self.scale = cfg.attention_scale or self.d ** -0.5
        self.window = cfg.window(layer)
        self.softcap = cfg.attn_softcap
        # One fused projection: one matmul per layer instead of three.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                cache: tuple[torch.Tensor, torch.Tensor] | None, batch: AttentionBatch,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """With keep_rows, every row's K/V still goes to the cache but only those rows' outputs are
        projected and returned (the last layer of a step whose other rows nobody reads)."""
        qkv = self.qkv_proj(x)  # [T, q + 2kv]
        kernels = batch.kernels
        if (kernels is not None and cache is not None and batch.decode_only and self.q_norm is None
                and self.window is None and self.softcap is None and qkv.dtype == torch.float32
                and rope.cos.dtype == torch.float32 and hasattr(kernels, "decode_attention")):
            # A decode step: rotary, the pool writes and attention in one native call (same bits).
            o = kernels.decode_attention(qkv, positions, rope.cos, rope.sin, rope.interleaved, self.hq, self.hkv,
                                         cache[0], cache[1], batch.slot_mapping, batch.decode_block_tables,
                                         batch.decode_rows, batch.decode_kv_lens, self.scale)
        else:
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=1)
            q = q.view(-1, self.hq, self.d)
            k = k.view(-1, self.hkv, self.d)
            v = v.view(-1, self.hkv, self.d)
            if self.q_norm is not None:
                q, k = head_norm(self.q_norm, q), head_norm(self.k_norm, k)
            q, k = rope(positions, q, k)
            o = paged_attention(q, k, v, cache, batch, scale=self.scale, window=self.window,
                                softcap=self.softcap).flatten(1)
        return self.o_proj(o if keep_rows is None else o[keep_rows])


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        self.inter = intermediate_size
        self.act = act
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.act == "gelu_tanh":
            return self.down_proj(F.gelu(gate_up[:, : self.inter], approximate="tanh") * gate_up[:, self.inter:])
        kernels = fused_kernels(gate_up)
        if kernels is not None:
            return self.down_proj(kernels.silu_and_mul(gate_up))
        return self.down_proj(F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter:])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        # Llama: the norm before the MLP. Gemma: the norm of the attention output, with two
        # more around the MLP.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, MLP) if cfg.is_moe(layer) else MLP(cfg.hidden_size, cfg.intermediate_size,
                                                                 cfg.hidden_act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: RotaryEmbedding, cache, batch: AttentionBatch,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output; residual: the running sum before it (None at
        the first layer, where x is the embedding). Returns this layer's MLP output and
        the residual stream without it, so the next norm can add and normalize in one pass.
        With keep_rows, both hold those rows only (each row's arithmetic is its own, so its
        bits do not change); every row's K/V is still cached."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, cache, batch, keep_rows)
        if keep_rows is not None:
            residual = residual[keep_rows]
        if self.sandwich:
            h = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def native_weights(self, kernels):
        """This layer for the C++ decoder stack (kernels.DecodeLayerWeights, sharing the weights),
        or None unless it is the plain Llama shape the stack runs: no query/key norms, sliding
        window, soft-capping or sandwich norms, a SiLU MLP, and every matmul a kernel layer."""
        attn, mlp = self.self_attn, self.mlp
        if (self.sandwich or attn.q_norm is not None or attn.window is not None or attn.softcap is not None
                or type(mlp) is not MLP or mlp.act != "silu"):
            return None
        linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        natives = [m.native() if isinstance(m, KernelLinear) else None for m in linears]
        if any(n is None for n in natives):
            return None
        return kernels.DecodeLayerWeights(self.input_layernorm.weight.detach(),
                                          self.post_attention_layernorm.weight.detach(), *natives)


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.build_rope()
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Decode steps run the whole stack in one C++ call where the model allows it (same bits);
        # off, they go layer by layer through the modules (the bench's breakdown times those).
        self.native_decode = True
        self._decode_stack = None  # built on the first decode step: None = not yet, False = cannot

    def decode_stack(self):
        """The C++ decoder stack for decode steps (kernels.DecodeStack), or None when this model
        cannot use one. Built once, after the weights are packed; it shares their storage."""
        if self._decode_stack is None:
            self._decode_stack = self._build_decode_stack() or False
        return self._decode_stack or None

    def _build_decode_stack(self):
        cfg = self.config
        kernels = load_kernels()
        if (kernels is None or not hasattr(kernels, "DecodeStack") or cfg.embedding_scale is not None
                or self.rope_local is not None or self.rope.cos.dtype != torch.float32
                or self.embed_tokens.weight.dtype != torch.float32 or self.norm.weight.dtype != torch.float32):
            return None
        layers = [layer.native_weights(kernels) for layer in self.layers]
        if any(w is None for w in layers):
            return None
        attn = self.layers[0].self_attn
        stack = kernels.DecodeStack(layers, self.norm.weight.detach(), self.norm.eps, self.rope.cos, self.rope.sin,
                                    self.rope.interleaved, attn.hq, attn.hkv, attn.scale)
        # The head joins the stack's call where it can (a quantized head on the team path); the
        # stack then returns the logits and their argmax (decode_logits).
        if self.config.final_softcap is None and isinstance(self.lm_head, KernelLinear):
            head = self.lm_head.native()
            if head is not None:
                stack.set_head(head)
                # With the embedding too, a plain decode step is one call on the engine's own lists
                # (decode_tokens).
                emb = self.embed_tokens
                if isinstance(emb, QuantizedEmbedding):  # looked up from the file's blocks
                    stack.set_embedding(emb.blocks, emb.kind)
                else:
                    stack.set_embedding(emb.weight.detach())
                # An exact quantized head can be screened with int8 activations on steps that need
                # only each row's argmax (kernels/greedy_head.cpp).
                screen = self.lm_head.greedy_screen() if isinstance(self.lm_head, QuantizedLinear) else None
                if screen is not None and stack.has_head:
                    stack.set_greedy_head(*screen)
        return stack

    def build_rope(self) -> None:
        """The RoPE tables; Gemma 3's sliding-window layers have their own base."""
        cfg = self.config
        self.rope = RotaryEmbedding(cfg)
        self.rope_local = None
        if cfg.rope_local_theta is not None:
            self.rope_local = RotaryEmbedding(cfg, cfg.rope_local_theta, RopeScaling())
        self.layer_ropes = [self.rope_local if self.rope_local is not None and cfg.window(i) else self.rope
                            for i in range(cfg.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                keep_rows: list[int] | None = None,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: [T]. `embeds` (rows [R], values [R, hidden]) replaces those rows'
        token embeddings (a vision model's image tokens). Returns final hidden states [T, hidden], or with keep_rows
        [len(keep_rows), hidden] for those rows alone. A prefill step reads the last prompt
        token's row only: past the last layer's K/V projection nothing of the others is needed,
        so its attention output, O projection and MLP run for the kept rows alone (the same bits
        for them; a 2,048-token step skips about 3% of its matmuls)."""
        x = self.embed_tokens(input_ids)  # a fresh tensor: the residual stream may be updated in place
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
        if (self.native_decode and kv_caches and batch.decode_only
                and (stack := self.decode_stack()) is not None):
            hidden = stack.forward(x, positions, [c[0] for c in kv_caches], [c[1] for c in kv_caches],
                                   batch.slot_mapping, batch.decode_block_tables, batch.decode_rows,
                                   batch.decode_kv_lens)
            return hidden if keep_rows is None else hidden[keep_rows]
        if self.config.embedding_scale is not None:
            x = x * self.config.embedding_scale
        residual = None
        last = len(self.layers) - 1
        kept = None if keep_rows is None else torch.tensor(keep_rows, dtype=torch.long)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.layer_ropes[i],
                                kv_caches[i] if kv_caches else None, batch, kept if i == last else None)
        return self.norm(x, residual)

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
                      before_native: Callable[[], None] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode-only step's logits [T, vocab] and their argmax [T] for every query, in one native
        call with the decoder stack: forward then logits_and_argmax, the same bits, without a
        second pass over the logits or the Python between them. None where the stack has no head.
        `before_native` runs right before that call, with nothing after it that lets the GIL go."""
        return self._stack_with_head("forward_logits", input_ids, positions, batch, kv_caches, before_native)

    def decode_argmax(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
                      before_native: Callable[[], None] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]] | None:
        """decode_logits for a step where nobody reads the logits (every row greedy), returned as
        decode_tokens returns them: the logits (of shape [T, 0] where the head's argmax was screened),
        the argmax (decode_logits' bits), the argmax as ints, and the rows whose maximum is a NaN.
        None where the stack has no head."""
        return self._stack_with_head("forward_argmax", input_ids, positions, batch, kv_caches, before_native)

    def _stack_with_head(self, method: str, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                         kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
                         before_native: Callable[[], None] | None):
        """A decode-only step through the stack's `method` (forward_logits or forward_argmax), or None
        where the step or the stack cannot take it."""
        if not (self.native_decode and kv_caches and batch.decode_only):
            return None
        stack = self.decode_stack()
        if stack is None or not stack.has_head:
            return None
        # A fresh tensor (the stack updates it in place).
        x = self.embed_tokens(input_ids)
        k_pools, v_pools = [c[0] for c in kv_caches], [c[1] for c in kv_caches]
        if before_native is not None:
            before_native()
        return getattr(stack, method)(x, positions, k_pools, v_pools, batch.slot_mapping, batch.decode_block_tables,
                                      batch.decode_rows, batch.decode_kv_lens)

    def decodes_tokens(self) -> bool:
        """Whether decode_tokens runs (the native stack has the head and the embedding)."""
        if not self.native_decode:
            return False
        stack = self.decode_stack()
        return stack is not None and stack.has_embedding

    def decode_tokens(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
                      pools: tuple[list[torch.Tensor], list[torch.Tensor]],
                      before_native: Callable[[], None] | None = None, argmax_only: bool = False,
                      interruptible: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]] | None:
        """A plain decode step (one query per sequence) from Python ints, where decodes_tokens():
        query i is token ids[i] at positions[i] of the sequence with block table tables[i], its K/V
        going to slots[i]. Returns decode_logits' logits and argmax, the argmax as ints, and the rows
        whose logits hold a NaN. Same bits as decode_logits; no tensor is made here, as each torch
        call costs tens of microseconds on the caches the step's weights have just flushed. With
        `argmax_only` (no row's logits are read) the stack may return logits of shape [T, 0] and the
        exact argmax found by screening (DecodeStack.set_greedy_head). With `interruptible`, None if
        interrupt_decode() stopped the step between two layers (nothing came of it; run again, it
        writes the same K/V)."""
        stack = self.decode_stack()
        if before_native is not None:
            before_native()
        found = stack.forward_tokens(ids, positions, slots, tables, pools[0], pools[1], argmax_only, interruptible)
        return None if interruptible and stack.interrupted else found

    def interrupt_decode(self) -> None:
        """Stop an interruptible decode_tokens step at its next layer boundary: the one running, or the
        next one to start before clear_decode_interrupt(). Safe from any thread."""
        stack = self._decode_stack
        if stack:
            stack.interrupt()

    def clear_decode_interrupt(self) -> None:
        """Withdraw an interrupt_decode() that no step has taken."""
        stack = self._decode_stack
        if stack:
            stack.clear_interrupt()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (bf16 logits would round near-ties into exact ties)."""
        return self.logits_and_argmax(hidden, want_argmax=False)[0]

    def logits_and_argmax(self, hidden: torch.Tensor, want_argmax: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [N, vocab] and, if asked, each row's argmax [N].

        Without the packed kernel, the head runs as W @ hidden^T (the faster BLAS shape
        here) in vocabulary slices that stay in cache; each slice's maximum is taken while
        it is still there, far cheaper than an argmax down the columns of [vocab, N]."""
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2: tanh soft-capping, before any argmax
            logits = self._raw_logits(hidden)
            logits = torch.tanh(logits / cap) * cap
            return logits, logits.argmax(dim=-1) if want_argmax else None
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

    def _raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, KernelLinear):
            return self.lm_head(hidden)
        w = self.lm_head.weight
        return F.linear(hidden.to(w.dtype), w).float()

    @torch.inference_mode()
    def dense_logits(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Logits for every position of each sequence, without any cache (the reference path)."""
        lens = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        pos = torch.cat([torch.arange(n) for n in lens])
        logits = self.compute_logits(self(ids, pos, AttentionBatch.dense(lens)))
        return list(logits.split(lens))


# The engine and older callers know the decoder by this name.
LlamaForCausalLM = DecoderForCausalLM
