"""Finishing a constrained answer within its token budget.

A constrained sequence that runs out of tokens mid-structure ends as invalid output. So each one
keeps count of the tokens it has left, and now and then asks how many tokens the cheapest known way
to an accepting state costs: a greedy walk from the matcher's current state (on a copy) that at each
step takes the allowed token that closes most, in this order: end of sequence (the grammar is
complete), the grammar's forced tokens, a quote that ends the current string, brackets that close,
a colon, a digit (the shortest JSON value), an opening quote, a comma (a required member still to
write), then the longest allowed token (a key name, an enum value, a literal). Every step is checked
by the matcher, so the walk can only produce text the grammar accepts; it is not always the shortest.

When the tokens left are no more than the walk's length plus a small margin, the sequence follows
the walk token by token (its mask holds that one token), so an answer whose budget can hold the
walk ends complete, with end of sequence. Otherwise it ends cut, with finish_reason "length".
Within a horizon of that point (as many spare tokens as the first walk is long), every step keeps
only the walk's next token and those of the model's likeliest tokens after which a walk still fits,
so the answer cannot open what it could no longer close (one more tool call, say).
The walk costs tens of microseconds a token and runs on a shrinking schedule: again after a third
of the spare tokens, and every step only within the horizon; requests without a grammar never get
here. docs/structured-output.md states what this guarantees.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import llguidance
import numpy as np
import torch

# Tokens left beyond the closing walk's length when the sequence starts to follow it.
MARGIN = 2
# Spare tokens below which every step is checked, at the least (see Budget.horizon).
ENDGAME = 8
# Near the end, how many of the model's likeliest allowed tokens are tried against the budget.
TOP_K = 4
_NEVER = -1e9


def _structural_score(text: str, raw: bytes) -> float:
    """Preference for a token outside a string (higher closes sooner)."""
    if text and set(text) <= set("}]"):
        return 5000 + len(text)  # closes one or more containers
    if text == ":":
        return 4500
    if text == "0":
        return 4100
    if len(text) == 1 and text.isdigit():
        return 4000
    if text == '""':
        return 3500  # an empty string value in one token
    if text == '"':
        return 3000
    if text == ",":
        return 2000
    if not text.strip():
        return -1000  # whitespace never helps
    return len(raw)


def _string_score(text: str, raw: bytes) -> float:
    """Preference for a token inside a string: end it (and close what follows), else fill it fast."""
    if text.startswith('"'):
        rest = text[1:]
        if set(rest) <= set("}]"):
            return 5000 + len(rest)
        return 4000 if rest in (",", ":") else 3900
    return len(raw)


class ClosingTable:
    """Per-token preferences over one tokenizer's vocabulary, built once (about 0.1 s for 49k tokens)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, eos_ids: list[int]) -> None:
        n = tokenizer.vocab_size
        self.vocab = n
        self.eos_ids = frozenset(eos_ids)
        self.token_bytes: list[bytes] = [tokenizer.decode_bytes([i]) for i in range(n)]
        structural = np.full(n, _NEVER, dtype=np.float32)
        in_string = np.full(n, _NEVER, dtype=np.float32)
        for i, raw in enumerate(self.token_bytes):
            if not raw:
                continue
            text = raw.decode("utf-8", "replace")
            structural[i] = _structural_score(text, raw)
            in_string[i] = _string_score(text, raw)
        for e in eos_ids:
            if 0 <= e < n:
                structural[e] = in_string[e] = 1e6
        self.structural, self.in_string = structural, in_string


@dataclass
class StringState:
    """Whether the text so far ends inside a JSON string (quotes and backslash escapes tracked).
    For grammars that are not JSON this is only a hint for the walk's order of preference."""

    inside: bool = False
    escaped: bool = False

    def feed(self, raw: bytes) -> None:
        for b in raw:
            if self.inside:
                if self.escaped:
                    self.escaped = False
                elif b == 0x5C:  # backslash
                    self.escaped = True
                elif b == 0x22:  # quote
                    self.inside = False
            elif b == 0x22:
                self.inside = True

    def copy(self) -> "StringState":
        return StringState(self.inside, self.escaped)


def allowed_tokens(matcher: llguidance.LLMatcher, vocab: int) -> np.ndarray:
    """The matcher's allowed-token mask as a bool array of length `vocab`."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


def closing_walk(matcher: llguidance.LLMatcher, strings: StringState, table: ClosingTable,
                 limit: int) -> list[int] | None:
    """Tokens from the matcher's state to the end of the answer (the last one is end of sequence),
    found greedily on a copy; None when no end was reached within `limit` tokens."""
    m = matcher.deep_copy()
    state = strings.copy()
    walk: list[int] = []
    while len(walk) < limit:
        forced = [t for t in m.compute_ff_tokens() if t not in table.eos_ids]
        if forced:
            if not m.consume_tokens(forced):
                return None
            walk += forced
            for t in forced:
                state.feed(table.token_bytes[t])
            continue
        allowed = allowed_tokens(m, table.vocab)
        if not allowed.any():
            return None
        scores = table.in_string if state.inside else table.structural
        token = int(np.where(allowed, scores, -np.inf).argmax())
        walk.append(token)
        if token in table.eos_ids:
            return walk
        if not m.consume_token(token):
            return None
        state.feed(table.token_bytes[token])
    return None


def _fits_after(matcher: llguidance.LLMatcher, strings: StringState, table: ClosingTable, token: int,
                limit: int) -> bool:
    """Whether, after `token`, a closing walk of at most `limit` tokens exists."""
    m = matcher.deep_copy()
    if not m.consume_token(token):
        return False
    state = strings.copy()
    state.feed(table.token_bytes[token])
    return limit >= 1 and closing_walk(m, state, table, limit) is not None


@dataclass
class Budget:
    """One constrained sequence's token budget and, once it must, the walk it follows to the end."""

    left: int
    strings: StringState = field(default_factory=StringState)
    check_at: int = -1  # look for the closing walk again when `left` is down to this (-1: at once)
    horizon: int = 0  # spare tokens below which every step is checked (set from the first walk)
    walk: deque[int] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.check_at < 0:
            self.check_at = self.left

    def consumed(self, token: int, raw: bytes) -> None:
        """The sequence took `token`: one fewer left, the string state moves on, the walk advances."""
        self.left -= 1
        self.strings.feed(raw)
        if self.walk:
            if self.walk[0] == token:
                self.walk.popleft()
            else:  # cannot happen under the one-token mask; plan again next step rather than trust it
                self.walk.clear()
                self.check_at = self.left

    def allowed(self, matcher: llguidance.LLMatcher, table: ClosingTable, logits: torch.Tensor) -> list[int] | None:
        """The tokens this step may take so the answer can still finish in time, or None while the
        sequence is free (the grammar's own mask applies). `logits`: this row's, to rank candidates."""
        if self.walk:
            return [self.walk[0]]
        if self.left > self.check_at or self.left <= 0:
            return None
        walk = closing_walk(matcher, self.strings, table, limit=self.left + 1)
        if walk is None:
            # No end within the budget from here: the answer will be cut ("length") unless the model
            # closes it itself; look again later in case it does part of the way.
            self.check_at = self.left - max(4, self.left // 4)
            return None
        if not self.horizon:
            # A single token can lengthen the walk by about as much as a whole shortest answer (one
            # more call after a complete one), so below that many spare tokens every step is checked.
            self.horizon = max(ENDGAME, len(walk))
        spare = self.left - len(walk) - MARGIN
        if len(walk) > self.left:
            # The walk itself no longer fits; the model's own way may be shorter (another branch of
            # the grammar), so it stays free and is looked at again next step.
            self.check_at = self.left - 1
            return None
        if spare <= 0:
            self.walk = deque(walk)
            return [walk[0]]
        if spare > self.horizon:
            # A token rarely adds more than two to the walk, so a third of the spare tokens may go
            # before the next look; it comes at the latest when the spare tokens reach the horizon.
            self.check_at = self.left - max(1, min(spare // 3, spare - self.horizon))
            return None
        self.check_at = self.left - 1
        return self._candidates(matcher, table, logits, walk)

    def _candidates(self, matcher: llguidance.LLMatcher, table: ClosingTable, logits: torch.Tensor,
                    walk: list[int]) -> list[int]:
        """Near the end: the walk's next token, and those of the model's likeliest allowed tokens
        after which a closing walk still fits the budget."""
        row = logits[:table.vocab].float().cpu().numpy()
        allowed = allowed_tokens(matcher, table.vocab)[:len(row)]
        ranked = np.where(allowed, row[:len(allowed)], -np.inf)
        top = np.argpartition(-ranked, TOP_K)[:TOP_K] if len(ranked) > TOP_K else np.arange(len(ranked))
        keep = [walk[0]]
        limit = self.left - 1 - MARGIN
        for token in (int(t) for t in top):
            if token == walk[0] or not np.isfinite(ranked[token]) or token in table.eos_ids:
                continue
            raw = table.token_bytes[token]
            if self.strings.inside and b'"' not in raw and b"\\" not in raw:
                fits = len(walk) <= limit  # more text inside a string: closing it costs the same
            else:
                fits = _fits_after(matcher, self.strings, table, token, limit)
            if fits:
                keep.append(token)
        return keep
