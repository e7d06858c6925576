"""Who guesses the next tokens: one small interface, and the n-gram (prompt lookup) proposer.

Prompt lookup needs no model: when the last few tokens already occurred earlier in the
prompt or the answer, the tokens that followed them then are a good guess for what
follows now. It pays off where answers repeat their input (rewriting a paragraph,
fixing code, quoting earlier turns) and costs almost nothing where they do not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from chatloom.engine.sequence import Sequence


@dataclass
class Proposal:
    tokens: list[int]
    # The proposer's own distribution for each proposed token ([len(tokens), vocab]), when
    # it sampled them; None for a deterministic guess (a point mass on each token).
    probs: torch.Tensor | None = None
    # What kind of guess this is, for the planner's acceptance estimate: for n-gram lookup the
    # length of the match (a 4-token match is kept far more often than a 1-token one); 0 when
    # the proposer has no such distinction.
    source: int = 0


class Proposer(Protocol):
    # True when proposing costs model forwards (a draft model): the planner then decides
    # the lengths before anything is proposed, instead of trimming ready proposals.
    costly: bool

    def propose(self, seqs: list[Sequence], max_lengths: list[int]) -> list[Proposal]:
        """Up to max_lengths[i] tokens to follow each sequence's tokens (may be fewer, or none)."""
        ...

    def verified(self, seq: Sequence) -> None:
        """The target has appended the accepted tokens to `seq` (keep any state in step)."""
        ...

    def forget(self, seq: Sequence) -> None:
        """`seq` finished, was aborted or preempted: drop what is kept for it."""
        ...


class _NgramIndex:
    """For each n, the latest end position of every n-gram, over all tokens but the last
    (so the sequence's own suffix is never its own match)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(min_n, max_n + 1)
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # grams ending before this position are in the index

    def update(self, tokens: list[int]) -> None:
        for end in range(self.indexed, len(tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self.last[n][tuple(tokens[end + 1 - n:end + 1])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """The continuation of the longest n-gram match of the suffix, most recent first, and n."""
        self.update(tokens)
        for n in reversed(self.sizes):
            if len(tokens) < n:
                continue
            end = self.last[n].get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k], n
        return [], 0


class NgramProposer:
    """Prompt lookup: propose what followed the longest recent earlier match of the last
    n tokens (n from max_n down to min_n) in the prompt and the output so far.

    Matches as short as one token are proposed too: the planner knows (Proposal.source) how
    often each match length is kept and proposes little or nothing after a weak match, while
    a step that checks one or two extra tokens costs almost nothing more at a small batch."""

    costly = False

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("n-gram sizes must satisfy 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, seqs: list[Sequence], max_lengths: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, max_lengths):
            if k <= 0:
                out.append(Proposal([]))
                continue
            index = self._index.get(seq.request_id)
            if index is None:
                index = self._index[seq.request_id] = _NgramIndex(self.min_n, self.max_n)
            tokens, n = index.lookup(seq.token_ids, k)
            out.append(Proposal(tokens, source=n))
        return out

    def verified(self, seq: Sequence) -> None:
        pass  # the index catches up lazily at the next lookup

    def forget(self, seq: Sequence) -> None:
        # A preempted sequence keeps its tokens, so its index stays valid; only a
        # finished one is dropped (the engine calls forget for those).
        self._index.pop(seq.request_id, None)
