"""Speculative verification: a step's logits rows into each sequence's new tokens.

A sequence that carried k proposed tokens has k + 1 rows of logits, in order (ModelRunner lays
decodes out that way): row j is the target's distribution after the j-th query. Its new tokens are
the longest acceptable run of proposals plus one token from the target (rejection.py holds the
rules). A sequence without proposals has one row and is sampled as usual. A row that cannot give a
token (NaN logits) fails its own sequence alone.
"""
from __future__ import annotations

import torch

from chatloom.engine.sampler import GreedyPicks, Sampler, SamplingError
from chatloom.engine.sequence import Sequence
from chatloom.engine.spec_decode.rejection import (Rule, accept_greedy, accept_sampled, ban_early_stops,
                                                   target_probs)


def verify_proposals(logits: torch.Tensor, argmax: torch.Tensor | None, sampled: list[Sequence],
                     sampler: Sampler, eos_ids: list[int], picks: GreedyPicks | None,
                     draft_probs: dict[str, torch.Tensor], rule: Rule
                     ) -> tuple[list[list[int]], dict[int, SamplingError]]:
    """New tokens for each sequence in `sampled`, and the sequences that failed (by index in
    `sampled`; they get no tokens). `picks`: every row's argmax and NaN rows, where the forward found
    them alone (every sequence greedy; the logits may then have no columns). `draft_probs`: the
    proposer's distributions by request id, where it has them (a draft model sampling)."""
    starts, row = [], 0
    for seq in sampled:
        starts.append(row)
        row += 1 + len(seq.spec_token_ids)
    plain = [i for i, s in enumerate(sampled) if not s.spec_token_ids]
    out: list[list[int]] = [[] for _ in sampled]
    failures: dict[int, SamplingError] = {}
    nan_rows = set(picks.nan_rows) if picks is not None else set()
    if plain:
        rows = [starts[i] for i in plain]
        sub_argmax = None if argmax is None else argmax[rows]
        sub_picks = None if picks is None else GreedyPicks(
            [picks.tokens[r] for r in rows], [j for j, r in enumerate(rows) if r in nan_rows])
        tokens, failed = sampler.sample(logits[rows], [sampled[i] for i in plain], eos_ids, sub_argmax, sub_picks)
        for j, (i, token) in enumerate(zip(plain, tokens)):
            if j in failed:
                failures[i] = failed[j]
            else:
                out[i] = [token]
    for i, seq in enumerate(sampled):
        proposed = seq.spec_token_ids
        if not proposed:
            continue
        span = range(starts[i], starts[i] + 1 + len(proposed))
        if picks is not None and seq.params.greedy:  # past min_tokens: the runner's rule for argmax-only steps
            if any(r in nan_rows for r in span):
                failures[i] = SamplingError.nan_logits()
                continue
            out[i] = accept_greedy([picks.tokens[r] for r in span], proposed)
            continue
        rows = logits[starts[i]:starts[i] + 1 + len(proposed)].float()
        banned = ban_early_stops(rows, seq, eos_ids)
        if seq.params.greedy:
            best = rows.argmax(dim=-1) if banned or argmax is None else argmax[span.start:span.stop]
            # argmax ranks NaN above every number: one look per row finds a failed row.
            if bool(torch.isnan(rows.gather(1, best.unsqueeze(1))).any()):
                failures[i] = SamplingError.nan_logits()
                continue
            out[i] = accept_greedy(best.tolist(), proposed)
        else:
            if bool(torch.isnan(rows).any()):
                failures[i] = SamplingError.nan_logits()
                continue
            q = draft_probs.get(seq.request_id)
            out[i] = accept_sampled(target_probs(rows, seq), proposed, None if q is None else q[:len(proposed)],
                                    seq.generator or sampler.generator, rule)
    return out, failures
