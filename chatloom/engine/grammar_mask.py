"""The grammar stage of a step: constrained requests' logits masked before any token is picked.

Runs between the forward pass and sampling or verification. The rows of constrained sequences get
the tokens their grammar forbids set to -inf (structured/guide.py computes the masks); free rows are
untouched. After the step's update, each matcher consumes its sequence's new token
(`GrammarGuide.advance`).
"""
from __future__ import annotations

import torch

from chatloom.engine.sequence import Sequence
from chatloom.engine.structured.guide import GrammarGuide


def apply_grammar_mask(guide: GrammarGuide, logits: torch.Tensor, sampled: list[Sequence]) -> bool:
    """Mask, in place, the rows of constrained sequences in `logits` (one row per sequence in `sampled`
    plus one per proposed token). Returns whether any row was masked: a precomputed argmax is then stale."""
    if not sampled or not len(guide):
        return False
    # Constrained sequences never propose, so their single row is the one masked; proposal rows get
    # no request id.
    row_ids = [rid for s in sampled for rid in [s.request_id] + [""] * len(s.spec_token_ids)]
    return guide.apply(logits, row_ids)
