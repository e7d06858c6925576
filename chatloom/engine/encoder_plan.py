"""Encoder work inside the step's budget: which pieces of which images a step encodes, and how far.

An image's encoder work comes in pieces (vision.piece_tokens: an Idefics3 / SmolVLM tile, encoded on
its own by SigLIP and the connector; a whole LLaVA image), and a piece's encoder layers may run in
slices across steps: a step runs layers start..stop-1 of a piece and leaves its hidden state in the
encoder cache (encoder_cache.py) for the next slice; the slice through the last layer also runs the
final norm and the connector and makes the piece's embeddings readable. The scheduler asks
`EncoderPlanner.fit` how far a sequence's prefill chunk may reach: the chunk runs up to the first
position whose piece is not finished by the end of this step, so the text before an image and the
streams of other users move on every step while an image is encoded a slice at a time. In a shared
step a chunk shorter than the piece it would stop at waits for the step that finishes that piece, where
the two fit one step's token budget together.

Work is counted in embedding-layers (a piece's embeddings x the layers run). A step runs a slice only
when all of these hold:

- tokens: the step's slices come to at most `token_budget` x the encoder's layers (as many whole pieces
  as `token_budget` embeddings); a step's first slice runs at least one layer;
- time: while the engine holds other requests (decoding, or with prompts to read), the encoder's
  measured time stays within `max_slowdown` of the time of the steps they share with it
  (`EncoderPacer`), so their time per output token rises by at most that on average. A slice in such
  a shared step is at most `EncoderPacer.slice_layers` layers of a piece, and the credit pays for
  about one. A step that would otherwise run nothing (every request waits for pieces the pacing held
  back) is not paced;
- memory: the pinned pieces, the partial states and what this slice leaves (a piece's hidden state, or
  its embeddings when it finishes) fit the encoder cache's limit.

Every piece a chunk reaches, and every piece with a slice planned, is pinned for its sequence until the
sequence's computed tokens are past it: a partial state lives only while pinned, so a sequence that
finishes, is aborted or is preempted frees the states it alone held.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from chatloom.engine.encoder_cache import EncoderCache, PieceKey
from chatloom.engine.sequence import Sequence
from chatloom.models.vision.prompt import ImageInput


# A shared step's slice costs about what this many shared steps earn the encoder (EncoderPacer.slice_layers).
SLICE_STEPS = 4


@dataclass(frozen=True, eq=False)
class PlannedPiece:
    """Layers start..stop-1 of one piece of an image, run this step (stop: the encoder's depth when the
    slice finishes the piece); `seq`: the sequence it was planned for, whose failure a failing slice is."""

    image: ImageInput
    index: int
    start: int
    stop: int
    seq: Sequence | None = None

    @property
    def key(self) -> PieceKey:
        return (self.image.content_hash, self.index)

    @property
    def num_tokens(self) -> int:
        return min(self.image.piece_len, self.image.num_tokens - self.index * self.image.piece_len)

    @property
    def work(self) -> int:
        """Embedding-layers: the unit the budget and the pacer count encoder work in."""
        return self.num_tokens * (self.stop - self.start)


class EncoderPacer:
    """The encoder's share of the time of steps shared with other requests.

    A credit in seconds: each shared step adds `max_slowdown` times its time outside the encoder and
    takes away what the encoder spent in it; a slice runs in such a step only when the credit pays for
    its estimated time (seconds per embedding-layer, measured). A slice is `slice_layers` layers of a
    piece, about what SLICE_STEPS shared steps earn, and the credit is capped at one slice, so a quiet
    spell buys one slice at once, not a burst. A step for one request alone delays nobody else: it
    encodes freely and neither adds nor takes credit.
    """

    def __init__(self, max_slowdown: float, layers: int = 1) -> None:
        self.max_slowdown = max_slowdown
        self.layers = layers  # the encoder's depth: a piece's layers
        self.seconds_per_unit: float | None = None  # per embedding-layer; None until a slice has run
        self.step_s: float | None = None  # shared steps' time outside the encoder, averaged
        self.credit = 0.0
        self.piece_tokens = 0  # the largest piece seen

    def slice_layers(self) -> int:
        """The most layers of one piece a shared step runs: what the credit earns in SLICE_STEPS shared
        steps at the measured costs, at least one layer and at most the whole encoder."""
        if math.isinf(self.max_slowdown):
            return self.layers
        if self.seconds_per_unit is None or self.step_s is None or not self.piece_tokens:
            return 1
        layer_s = self.seconds_per_unit * self.piece_tokens
        return max(1, min(self.layers, int(self.max_slowdown * self.step_s * SLICE_STEPS / layer_s)))

    def affordable(self, planned: int, tokens: int, layers: int) -> int:
        """How many of `layers` layers of a piece of `tokens` embeddings the credit pays for in a shared
        step that has `planned` embedding-layers planned already (with nothing measured yet: one layer,
        which measures the cost)."""
        if self.max_slowdown <= 0:
            return 0
        if math.isinf(self.max_slowdown):  # not paced: the token budget alone bounds a step's slices
            return layers
        if self.seconds_per_unit is None:
            return min(layers, 1) if not planned else 0
        paid = self.credit / self.seconds_per_unit - planned
        return max(0, min(layers, int(paid / tokens + 1e-9)))

    def record(self, shared: bool, step_s: float, encoder_s: float, encoder_work: int) -> None:
        """One step's times: the whole step, and the encoder's part of it for `encoder_work` embedding-layers."""
        if encoder_work:
            rate = encoder_s / encoder_work
            old = self.seconds_per_unit
            self.seconds_per_unit = rate if old is None else 0.7 * old + 0.3 * rate
        if shared:
            outside = max(step_s - encoder_s, 0.0)
            self.step_s = outside if self.step_s is None else 0.9 * self.step_s + 0.1 * outside
            self.credit += self.max_slowdown * outside - encoder_s
            cap = (self.seconds_per_unit or 0.0) * self.slice_layers() * self.piece_tokens
            self.credit = min(self.credit, cap)


class EncoderPlanner:
    """This step's slices to run (`plan`), and the pins each sequence holds on its pieces."""

    def __init__(self, cache: EncoderCache, bytes_per_embedding: int, token_budget: int,
                 pacer: EncoderPacer, layers: int = 1, state_bytes: int = 0) -> None:
        self.cache = cache
        self.bytes_per_embedding = bytes_per_embedding
        self.token_budget = token_budget
        self.pacer = pacer
        self.layers = layers  # the encoder's depth
        self.state_bytes = state_bytes  # one piece's hidden state between slices
        pacer.layers = layers
        self.plan: dict[PieceKey, PlannedPiece] = {}
        self._planned_work = 0
        self._planned_bytes = 0  # what the planned slices add to what the cache holds pinned
        self.shared = False  # whether this step is shared with other requests (paced)
        self.held_short = False  # whether the last `fit` held a short chunk back for its piece
        # Each sequence's pinned pieces, with the last prompt position each one fills.
        self.pins: dict[Sequence, dict[PieceKey, int]] = {}

    def begin_step(self, shared: bool) -> None:
        """A new plan; `shared`: encoder work in this step would delay other requests, so it is paced."""
        self.plan = {}
        self._planned_work = self._planned_bytes = 0
        self.shared = shared

    def take_plan(self) -> list[PlannedPiece]:
        plan = list(self.plan.values())
        self.begin_step(self.shared)
        return plan

    def planned_for(self, seq: Sequence) -> bool:
        """Whether this step runs a slice planned for `seq`."""
        return any(p.seq is seq for p in self.plan.values())

    def fit(self, seq: Sequence, n: int) -> int:
        """How many of the next `n` prompt tokens of `seq` can run this step: up to the first image
        position whose piece is not finished by the end of this step. Plans slices of the pieces the
        chunk reaches and pins them, and every cached piece it reaches, for `seq`. Sets `held_short`
        when the chunk was held back to be read with the piece it stops at."""
        self.held_short = False
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        pins = self.pins.setdefault(seq, {})
        for image in seq.images:
            lo, hi = bisect.bisect_left(image.positions, start), bisect.bisect_left(image.positions, end)
            if lo >= hi:
                continue
            size = image.piece_len
            for index in range(lo // size, (hi - 1) // size + 1):
                key = (image.content_hash, index)
                planned = None
                if key not in self.cache:
                    planned = self.plan.get(key) or self._plan(seq, image, index)
                if (key in self.cache or planned is not None) and key not in pins:
                    pins[key] = image.piece_last_position(index)
                    self.cache.pin(key)
                if key not in self.cache and (planned is None or planned.stop < self.layers):
                    reach = max(image.piece_first_position(index) - start, 0)
                    # In a shared step, a chunk shorter than the piece it stops at waits to be read with
                    # that piece: now it would lengthen the others' step and bring the first token no
                    # closer (the encoder sets that); with the piece it adds to a step that runs anyway.
                    # Only where both fit one step, so the request's prefill takes no step more.
                    self.held_short = self.shared and 0 < reach < size and reach + size <= self.token_budget
                    return 0 if self.held_short else reach
        return n

    def _plan(self, seq: Sequence, image: ImageInput, index: int) -> PlannedPiece | None:
        """The next slice of a piece that fits this step's budget, time and memory; None if none does."""
        key = (image.content_hash, index)
        tokens = min(image.piece_len, image.num_tokens - index * image.piece_len)
        self.pacer.piece_tokens = max(self.pacer.piece_tokens, tokens)
        done = self.cache.layers_done(key)
        layers = self.layers - done
        room = (self.token_budget * self.layers - self._planned_work) // tokens
        layers = min(layers, room if self._planned_work else max(room, 1))
        if self.shared:
            layers = min(layers, self.pacer.slice_layers())
            layers = self.pacer.affordable(self._planned_work, tokens, layers)
        if layers <= 0:
            return None
        stop = done + layers
        own = self.cache.partial_bytes(key)  # the state this slice replaces
        new = tokens * self.bytes_per_embedding if stop == self.layers else self.state_bytes
        held = self.cache.pinned_bytes - own + self._planned_bytes
        # A piece larger than the whole limit still runs when nothing else is held (and leaves once read).
        if held + new > self.cache.max_bytes and held > 0:
            return None
        piece = PlannedPiece(image, index, done, stop, seq)
        self.plan[key] = piece
        self._planned_work += piece.work
        self._planned_bytes += new - own
        return piece

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
