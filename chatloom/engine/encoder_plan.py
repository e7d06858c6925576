"""Encoder work inside the step's budget: which pieces of which images a step encodes.

An image's encoder work comes in pieces (vision.piece_tokens: an Idefics3 / SmolVLM tile, encoded on
its own by SigLIP and the connector; a whole LLaVA image). The scheduler asks `EncoderPlanner.fit` how
far a sequence's prefill chunk may reach: the chunk runs up to the first position whose piece is
neither in the encoder cache nor encodable this step, so the text before an image and the streams of
other users move on every step while an image is encoded a few pieces at a time.

A step encodes a piece only when all of these hold:

- tokens: the step's pieces give at most `token_budget` embeddings (a piece larger than that runs
  alone in its step);
- time: while the engine holds other requests (decoding, or with prompts to read), the encoder's
  measured time stays within `max_slowdown` of the time of the steps they share with it
  (`EncoderPacer`), so their time per output token rises by at most that on average. A step that would
  otherwise run nothing (every request waits for pieces the pacing held back) is not paced;
- memory: the pinned pieces and this one fit the encoder cache's limit (encoder_cache.py).

Every piece a chunk reaches is pinned for its sequence until the sequence's computed tokens are past it.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from chatloom.engine.encoder_cache import EncoderCache, PieceKey
from chatloom.engine.sequence import Sequence
from chatloom.models.vision.prompt import ImageInput


@dataclass(frozen=True, eq=False)
class PlannedPiece:
    image: ImageInput
    index: int

    @property
    def key(self) -> PieceKey:
        return (self.image.content_hash, self.index)

    @property
    def num_tokens(self) -> int:
        return min(self.image.piece_len, self.image.num_tokens - self.index * self.image.piece_len)


class EncoderPacer:
    """The encoder's share of the time of steps shared with other requests.

    A credit in seconds: each shared step adds `max_slowdown` times its time outside the encoder and
    takes away what the encoder spent in it; a piece runs in such a step only when the credit pays for
    its estimated time (seconds per embedding, measured). The credit is capped at one piece's estimate,
    so a quiet spell buys one piece at once, not a burst. A step for one request alone delays nobody
    else: it encodes freely and neither adds nor takes credit.
    """

    def __init__(self, max_slowdown: float) -> None:
        self.max_slowdown = max_slowdown
        self.seconds_per_token: float | None = None  # measured; None until a piece has run
        self.credit = 0.0
        self.piece_tokens = 0  # the largest piece seen: the credit's cap

    def allows(self, tokens: int) -> bool:
        """Whether encoding `tokens` embeddings in a shared step stays within the credit (with
        any slowdown allowed, a first piece always does: it measures the cost)."""
        if self.max_slowdown <= 0:
            return False
        if math.isinf(self.max_slowdown):  # not paced: the token budget alone bounds a step's pieces
            return True
        if self.seconds_per_token is None:
            return tokens <= self.piece_tokens  # one piece, to measure
        return self.credit >= self.seconds_per_token * tokens

    def record(self, shared: bool, step_s: float, encoder_s: float, encoder_tokens: int) -> None:
        """One step's times: the whole step, and the encoder's part of it for `encoder_tokens` embeddings."""
        if encoder_tokens:
            rate = encoder_s / encoder_tokens
            old = self.seconds_per_token
            self.seconds_per_token = rate if old is None else 0.7 * old + 0.3 * rate
        if shared:
            self.credit += self.max_slowdown * max(step_s - encoder_s, 0.0) - encoder_s
            self.credit = min(self.credit, (self.seconds_per_token or 0.0) * self.piece_tokens)


class EncoderPlanner:
    """This step's pieces to encode (`plan`), and the pins each sequence holds on its pieces."""

    def __init__(self, cache: EncoderCache, bytes_per_embedding: int, token_budget: int,
                 pacer: EncoderPacer) -> None:
        self.cache = cache
        self.bytes_per_embedding = bytes_per_embedding
        self.token_budget = token_budget
        self.pacer = pacer
        self.plan: dict[PieceKey, PlannedPiece] = {}
        self._planned_tokens = 0
        self.shared = False  # whether this step is shared with other requests (paced)
        # Each sequence's pinned pieces, with the last prompt position each one fills.
        self.pins: dict[Sequence, dict[PieceKey, int]] = {}

    def begin_step(self, shared: bool) -> None:
        """A new plan; `shared`: encoder work in this step would delay other requests, so it is paced."""
        self.plan = {}
        self._planned_tokens = 0
        self.shared = shared

    def take_plan(self) -> list[PlannedPiece]:
        plan, self.plan, self._planned_tokens = list(self.plan.values()), {}, 0
        return plan

    def fit(self, seq: Sequence, n: int) -> int:
        """How many of the next `n` prompt tokens of `seq` can run this step: up to the first image
        position whose piece is neither cached nor encodable now. Pins every piece the chunk reaches and
        adds the ones to encode to the plan."""
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        pins = self.pins.setdefault(seq, {})
        for image in seq.images:
            lo, hi = bisect.bisect_left(image.positions, start), bisect.bisect_left(image.positions, end)
            if lo >= hi:
                continue
            size = image.piece_len
            for index in range(lo // size, (hi - 1) // size + 1):
                piece = PlannedPiece(image, index)
                key = piece.key
                if key not in self.plan and key not in self.cache:
                    if not self._can_encode(piece.num_tokens):
                        return max(image.piece_first_position(index) - start, 0)
                    self.plan[key] = piece
                    self._planned_tokens += piece.num_tokens
                if key not in pins:
                    pins[key] = image.piece_last_position(index)
                    self.cache.pin(key)
        return n

    def _can_encode(self, tokens: int) -> bool:
        self.pacer.piece_tokens = max(self.pacer.piece_tokens, tokens)
        planned = self._planned_tokens
        if planned and planned + tokens > self.token_budget:
            return False
        if self.shared and not self.pacer.allows(planned + tokens):
            return False
        held = self.cache.pinned_bytes + planned * self.bytes_per_embedding
        # A piece larger than the whole limit still runs when nothing else is held (and leaves once read).
        return held + tokens * self.bytes_per_embedding <= self.cache.max_bytes or held == 0

    def consumed(self, seq: Sequence) -> None:
        """Unpin the pieces `seq`'s computed tokens have passed; drop prepared images it is done with."""
        pins = self.pins.get(seq)
        if pins:
            for key in [k for k, last in pins.items() if last < seq.num_computed_tokens]:
                del pins[key]
                self.cache.unpin(key)
        for image in seq.images:
            if image.prepared is not None and image.positions[-1] < seq.num_computed_tokens:
                image.prepared = None

    def forget(self, seq: Sequence) -> None:
        """Unpin everything `seq` holds (finished, aborted or preempted)."""
        for key in self.pins.pop(seq, {}):
            self.cache.unpin(key)
