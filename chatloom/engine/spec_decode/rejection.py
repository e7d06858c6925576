"""Turn the target's logits over [last token, proposed tokens...] into the tokens to keep.

Row j of a sequence's logits is the target's distribution for the token after the j-th
query, so row j judges proposed token j+1 and the row after the last kept proposal gives
one more token for free (the correction at a rejection, or the bonus when all pass).

Greedy requests keep proposals while they equal the target's argmax: the output is the
very tokens the target alone would pick. Sampled requests use the rule of Leviathan et
al. and Chen et al.: keep proposal d with probability min(1, p(d)/q(d)); at the first
rejection draw from normalize(max(0, p - q)); after a full run draw the bonus from p.
A deterministic proposer has q = a point mass on d, so it is kept with probability p(d)
and the residual is p without d. Either way each kept token is distributed exactly as
the target's own sampling would make it.
"""
from __future__ import annotations

from typing import Callable

import torch

from chatloom.engine.sampler import _filter_top_k_top_p, draw_token
from chatloom.engine.sequence import Sequence


def ban_early_stops(logits: torch.Tensor, seq: Sequence, eos_ids: list[int]) -> bool:
    """min_tokens: no end-of-sequence token in rows whose output index is below it (in place).
    Row j is output token number seq.num_output_tokens + j. Returns whether any row changed."""
    p = seq.params
    early = p.min_tokens - seq.num_output_tokens
    if early <= 0:
        return False
    banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
    if not banned:
        return False
    logits[:early, banned] = float("-inf")
    return True


def target_probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The distribution the sampler would draw from for each row: temperature, top-k, top-p."""
    p = seq.params
    rows = logits.float() / p.temperature
    if p.top_k > 0 or p.top_p < 1:
        n = rows.shape[0]
        rows = _filter_top_k_top_p(rows, torch.full((n,), p.top_k), torch.full((n,), p.top_p, dtype=torch.float32))
    return rows.softmax(dim=-1)


def accept_greedy(target_argmax: list[int], proposed: list[int]) -> list[int]:
    """Proposals up to the first that differs from the target's choice, then the target's choice."""
    out = []
    for j, token in enumerate(proposed):
        if token != target_argmax[j]:
            break
        out.append(token)
    out.append(target_argmax[len(out)])
    return out


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """normalize(max(0, p - q)); q None means a point mass on `token`."""
    if q is None:
        r = p.clone()
        r[token] = 0
    else:
        r = (p - q).clamp_(min=0)
    total = float(r.sum())
    # p == q (or p all on the proposal): the rejection had probability 0; fall back to p.
    return r / total if total > 0 else p


# A rule maps (p row, q row or None, proposed token, generator) to (kept?, token to emit
# when not kept). Tests swap in deliberately wrong rules to show the statistics notice.
Rule = Callable[[torch.Tensor, torch.Tensor | None, int, torch.Generator], tuple[bool, int]]


def exact_rule(p: torch.Tensor, q: torch.Tensor | None, token: int, gen: torch.Generator) -> tuple[bool, int]:
    if q is None:
        # A point mass: draw the target's token with the very uniform the sampler would use
        # and keep the proposal if they agree. That keeps it with probability p(d) and
        # otherwise gives p without d, renormalized: the rule above for q = 1 at d. And a
        # seeded request emits exactly the tokens it emits without speculation.
        drawn = draw_token(p, gen)
        return drawn == token, drawn
    u = float(torch.rand(1, generator=gen, dtype=torch.float64))
    q_token = float(q[token])
    if q_token > 0 and u * q_token < float(p[token]):
        return True, token
    return False, draw_token(residual(p, q, token), gen)


def accept_sampled(probs: torch.Tensor, proposed: list[int], draft_probs: torch.Tensor | None,
                   gen: torch.Generator, rule: Rule = exact_rule) -> list[int]:
    """probs: the target's [len(proposed) + 1, vocab] distributions; draft_probs the
    proposer's [len(proposed), vocab] or None (deterministic proposals)."""
    out = []
    for j, token in enumerate(proposed):
        kept, emit = rule(probs[j], None if draft_probs is None else draft_probs[j], token, gen)
        out.append(emit)
        if not kept:
            return out
    out.append(draw_token(probs[len(proposed)], gen))
    return out
