"""Pick the next token of each sequence from its logits."""
from __future__ import annotations

import torch

from chatloom.engine.sequence import Sequence


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside each row's top-k and top-p nucleus. logits: [N, V] float32."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    cum_before = probs.cumsum(dim=-1) - probs
    drop |= cum_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def draw_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` [vocab] by inverse CDF of a single uniform draw. One draw
    per token keeps a seeded request's stream aligned however its tokens are produced
    (speculative decoding checks proposals against this same draw)."""
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int],
                 argmax: torch.Tensor | None = None) -> list[int]:
        """logits: [N, vocab]; argmax: their row-wise argmax when the caller has it already."""
        logits = logits.float()
        # min_tokens: end-of-sequence tokens are not allowed yet.
        banned_any = False
        for row, seq in enumerate(seqs):
            p = seq.params
            if seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
                if banned:
                    logits[row, banned] = float("-inf")
                    banned_any = True
        if argmax is None or banned_any:
            argmax = logits.argmax(dim=-1)
        out = argmax.tolist()
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not rows:
            return out
        sub = logits[rows]
        temps = torch.tensor([seqs[i].params.temperature for i in rows], dtype=torch.float32)
        sub = sub / temps.unsqueeze(1)
        top_k = torch.tensor([seqs[i].params.top_k for i in rows])
        top_p = torch.tensor([seqs[i].params.top_p for i in rows], dtype=torch.float32)
        if bool((top_k > 0).any() or (top_p < 1).any()):
            sub = _filter_top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        for j, i in enumerate(rows):
            # A seeded request draws from its own generator: same seed, same text, whatever the batch.
            gen = seqs[i].generator or self.generator
            out[i] = draw_token(probs[j], gen)
        return out
