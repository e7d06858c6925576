"""The engine's side of constrained decoding: matchers per sequence, one batched mask per step.

Each step, the rows of constrained sequences get their allowed-token bitmasks computed into one
tensor and disallowed logits set to -inf in one masked_fill; free rows are untouched, so constrained and free requests share every forward pass. After
sampling, each matcher consumes its sequence's token. A matcher's state lives as long as its
sequence, so preemption by recompute (which keeps the tokens) needs nothing special.
A sequence added with a token budget is steered to finish its structure before the budget runs out
(see closing.py): near the end its mask may hold only the next token of the closing walk.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import llguidance
# The numpy helpers, not llguidance.torch: that module applies torch.compile at import, which pulls in
# torch._dynamo and inductor (about 1.5 s of CPU at every engine start) for a kernel not used here.
import llguidance.numpy as llg_numpy
import torch

from chatloom.engine.sampling_params import InvalidRequest
from chatloom.engine.structured.closing import Budget, ClosingTable
from chatloom.engine.structured.constraint import Constraint, ConstraintError

log = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, W] int32 bitmasks (bit j of word w: token 32w+j allowed) -> [N, vocab] bool allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab:  # logits wider than the tokenizer (padded embedding rows): never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed[:, :vocab]


def _bits(tokens: list[int], words: int) -> torch.Tensor:
    """One bitmask row ([words] int32) allowing exactly `tokens` (a handful)."""
    row = torch.zeros(words, dtype=torch.int32)
    packed: dict[int, int] = {}
    for t in tokens:
        packed[t // 32] = packed.get(t // 32, 0) | 1 << (t % 32)
    for word, bits in packed.items():
        row[word] = bits - (1 << 32) if bits >= 1 << 31 else bits  # as int32
    return row


@dataclass
class MaskStats:
    """Time spent computing and applying masks, for `chatloom bench structured`."""

    steps: int = 0
    rows: int = 0
    seconds: float = 0.0  # computing and applying masks
    advance_seconds: float = 0.0  # matchers consuming the sampled tokens
    per_step: list[float] = field(default_factory=list)

    def record(self, rows: int, seconds: float) -> None:
        self.steps += 1
        self.rows += rows
        self.seconds += seconds
        self.per_step.append(seconds)


class GrammarGuide:
    """Matchers of one engine's constrained sequences. `tokenizer` is chatloom's TextTokenizer."""

    def __init__(self, tokenizer, eos_ids: list[int]) -> None:
        self._text_tokenizer = tokenizer
        self._eos_ids = list(eos_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._budgets: dict[str, Budget] = {}
        self._closing: ClosingTable | None = None
        self.stats = MaskStats()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        # Built on first use (about 1 s for a 49k vocabulary), then shared by every matcher.
        if self._ll_tokenizer is None:
            tok = self._text_tokenizer
            self._ll_tokenizer = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=tok.vocab_size,
                                                        eos_token=self._eos_ids or None)
        return self._ll_tokenizer

    @property
    def closing_table(self) -> ClosingTable:
        if self._closing is None:
            self._closing = ClosingTable(self.ll_tokenizer, self._eos_ids)
        return self._closing

    def add(self, request_id: str, constraint: Constraint, budget: int | None = None) -> None:
        """Start a matcher for a new sequence; InvalidRequest if its grammar does not compile.
        `budget`: the most tokens the sequence may generate (end of sequence included); with it the
        sequence is steered to complete its structure in time. None: not steered."""
        try:
            grammar = constraint.grammar
        except ConstraintError as exc:
            raise InvalidRequest(str(exc)) from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"cannot compile the {constraint.kind} constraint: {matcher.get_error()}")
        self._matchers[request_id] = matcher
        if budget is not None and self._eos_ids:
            self.closing_table  # noqa: B018 - built now, not in the middle of a step
            self._budgets[request_id] = Budget(budget)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._budgets.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    @torch.inference_mode()  # the runner's logits are inference tensors
    def apply(self, logits: torch.Tensor, request_ids: list[str]) -> bool:
        """Mask, in place, the rows of `logits` ([N, V]) whose request is constrained.
        Returns whether any row was masked (then a precomputed argmax is stale)."""
        rows = [(i, r, self._matchers[r]) for i, r in enumerate(request_ids) if r in self._matchers]
        if not rows:
            return False
        t0 = time.perf_counter()
        words = llg_numpy.allocate_token_bitmask(len(rows), self.ll_tokenizer.vocab_size)
        bitmask = torch.from_numpy(words)  # the same memory: the matcher writes words, torch reads bitmask
        # One row after another in this thread: llguidance's parallel executor keeps worker threads that
        # spin after each batch and, on a small CPU, steal the cores torch's OpenMP threads need
        # (measured: every forward pass slowed 20x). Per row the mask costs tens of microseconds.
        for j, (i, request_id, matcher) in enumerate(rows):
            budget = self._budgets.get(request_id)
            tokens = budget.allowed(matcher, self._closing, logits[i]) if budget is not None else None
            if tokens is None:
                llg_numpy.fill_next_token_bitmask(matcher, words, j)
            else:  # finishing within the budget: only tokens after which the answer can still close
                bitmask[j] = _bits(tokens, bitmask.shape[1])
        allowed = bitmask_to_bool(bitmask, logits.shape[-1])
        # A matcher in an error state allows nothing; let it end with EOS rather than sample from all -inf.
        stuck = ~allowed.any(dim=1)
        if bool(stuck.any()) and self._eos_ids:
            allowed[stuck.nonzero().flatten().unsqueeze(1), torch.tensor(self._eos_ids)] = True
        index = torch.tensor([i for i, _, _ in rows])
        sub = logits[index]
        logits[index] = sub.masked_fill(~allowed, float("-inf")).to(logits.dtype)
        self.stats.record(len(rows), time.perf_counter() - t0)
        return True

    def advance(self, request_id: str, token: int) -> bool:
        """Feed a sampled token to the request's matcher. False when the matcher rejects it
        (it cannot, as the token was sampled under its mask, unless the mask was all -inf)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True
        budget = self._budgets.get(request_id)
        if budget is not None:
            budget.consumed(token, self._closing.token_bytes[token] if 0 <= token < self._closing.vocab else b"")
        if token in self._eos_ids and matcher.is_accepting():
            return True
        t0 = time.perf_counter()
        ok = matcher.consume_token(token)
        self.stats.advance_seconds += time.perf_counter() - t0
        if not ok:
            log.warning("constrained request %s: token %d rejected (%s)", request_id, token, matcher.get_error())
        return ok

    def is_complete(self, request_id: str) -> bool:
        """The grammar is finished and allows nothing more (the sequence should stop now)."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_stopped()
