"""Log probabilities of the tokens a step produced, for the requests that ask (SamplingParams.logprobs).

They are the model's own distribution: the log-softmax of the raw logits of the step, before
temperature, top-k, top-p, the masks of structured output and the ban of end tokens under min_tokens
(vLLM's default "raw" mode). So they say how likely the model found each token whatever the sampling
settings, and stay meaningful at temperature 0, where the distribution actually drawn from is a single
token. Only the rows that ask are converted; the rest of the batch pays nothing.
"""
from __future__ import annotations

import torch

from chatloom.engine.outputs import TokenLogprob
from chatloom.engine.sequence import Sequence


def asking_rows(sampled: list[Sequence]) -> list[tuple[int, int]]:
    """(index in `sampled`, row of the logits) of each sequence whose logprobs are asked. Such a sequence
    never speculates, so it has one row; others may have a row more per proposed token."""
    out, row = [], 0
    for i, seq in enumerate(sampled):
        if seq.params.logprobs is not None:
            out.append((i, row))
        row += 1 + len(seq.spec_token_ids)
    return out


def log_softmax_rows(logits: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor | None:
    """The asking rows' log probabilities [len(rows), vocab], float32, taken before anything masks the logits."""
    if not rows or logits.dim() != 2 or logits.shape[-1] == 0:
        return None
    return logits[[r for _, r in rows]].float().log_softmax(dim=-1)


def entries(logprobs: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """One TokenLogprob per row of `logprobs` [R, vocab] for tokens[r], with the row's k likeliest tokens."""
    if not tokens:
        return []
    index = torch.tensor(tokens, dtype=torch.long).unsqueeze(1)
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    if k > 0:
        values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]


def sampled_entries(logprobs: torch.Tensor | None, rows: list[tuple[int, int]], sampled: list[Sequence],
                    new_tokens: list[list[int]], failed: dict) -> dict[int, list[TokenLogprob]]:
    """By index in `sampled`: the entry for the token each asking sequence drew (none where it failed)."""
    if logprobs is None:
        return {}
    by_k: dict[int, list[tuple[int, int]]] = {}
    for j, (i, _) in enumerate(rows):
        if i not in failed and new_tokens[i]:
            by_k.setdefault(sampled[i].params.logprobs, []).append((j, i))
    out: dict[int, list[TokenLogprob]] = {}
    for k, pairs in by_k.items():
        found = entries(logprobs[[j for j, _ in pairs]], [new_tokens[i][0] for _, i in pairs], k)
        out.update({i: [e] for (_, i), e in zip(pairs, found)})
    return out


def prompt_entries(seq: Sequence, start: int, logits: torch.Tensor) -> list[TokenLogprob]:
    """Entries for the prompt tokens a prefill chunk's logits predict: row j of `logits` (the chunk's
    query at position start + j) gives the next token's. Only positions not already known are returned,
    so a chunk computed again (after a preemption) adds nothing twice."""
    known = len(seq.prompt_logprobs)
    first, end = max(start + 1, known), min(start + logits.shape[0] + 1, seq.prompt_len)
    if first >= end:
        return []
    rows = logits[first - 1 - start:end - 1 - start].float().log_softmax(dim=-1)
    return entries(rows, seq.token_ids[first:end], seq.params.prompt_logprobs)
