"""The first stage of a step: which sequences run and how many tokens each, under a token budget.

Iteration-level (continuous) batching with chunked prefill and preemption by recompute. The scheduler
owns the waiting and running queues and decides; the KV-cache manager (kv_cache_manager.py) gives
the blocks its plan needs. Its limits come from the engine's configuration (scheduler_config.SchedulerConfig).
"""
from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from chatloom.engine.kv_cache_manager import KVCacheManager
from chatloom.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # names in annotations only: a text-only scheduler never loads the encoder's planner
    from chatloom.engine.scheduler_config import SchedulerConfig
    from chatloom.engine.encoder_plan import EncoderPlanner, PlannedPiece


# The most queries (decodes, proposed tokens and prompt tokens) of a step whose prompt chunks run as
# decode queries: the native decode stack's team path takes up to 12 rows.
MIXED_AS_DECODE_QUERIES = 12


@dataclass
class ScheduledBatch:
    """One step's plan, what the model runner executes."""

    # Running sequences taking one token each, then prefill chunks (seq, number of tokens).
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Slices of image pieces' encoder layers to run before the forward (encoder_plan.py), cached as
    # they finish; a step may carry them alone (a piece part-way through the encoder is read by nobody yet).
    encode: list[PlannedPiece] = field(default_factory=list)
    # Only background (batch) sequences in it: the engine counts its time as such.
    background_only: bool = False
    # Background decodes alone: the step may stop between layers when foreground work arrives (the
    # engine's interrupt_background), and is then planned again.
    interruptible: bool = False

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens riding on the decodes (speculative decoding)."""
        return sum(len(s.spec_token_ids) for s in self.decodes)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + self.num_spec_tokens + sum(n for _, n in self.prefills)

    @property
    def short_mixed(self) -> bool:
        """Decodes and prompt chunks, at most MIXED_AS_DECODE_QUERIES queries in all: the model runner
        runs the chunks' tokens as decode queries, on the native decode stack where the model has one."""
        return bool(self.decodes and self.prefills) and self.num_tokens <= MIXED_AS_DECODE_QUERIES

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills or self.encode)


# Sequence.sort_key's order (priority, then arrival), read without a property call per sequence.
_SORT_KEY = operator.attrgetter("priority", "arrival_order")


class Scheduler:
    """The waiting and running queues, and each step's plan over them (`schedule`)."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # A vision model's encoder work, in pieces inside each step's budget (encoder_plan.py); None: a
        # text model, whose chunks reach no image.
        self.encoder: EncoderPlanner | None = None
        # Frees the blocks of one round held while its tools run (kv_holds.py), not the one this sequence
        # resumes; False when none is held. Held blocks give way before any preemption or refusal.
        self.reclaim: Callable[[Sequence], bool] = lambda seq: False
        # Set while the server knows of a foreground request on its way in (admitted, not yet here or not
        # yet answered): background sequences sit out every step meanwhile, so the request never waits
        # for a step of them that began while it was on its way.
        self.background_held = False

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        keys = [s.sort_key for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.sort_key), seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (finish or abort)."""
        if self.encoder is not None:
            self.encoder.forget(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free_sequence(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def only_held_work(self) -> bool:
        """Whether every queued sequence is background work sitting out a hold (a step would run nothing)."""
        floor = self.config.background_priority
        return (self.background_held and floor is not None
                and all(seq.priority >= floor for seq in self.running)
                and all(seq.priority >= floor for seq in self.waiting))

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        if self.encoder is not None:
            self.encoder.forget(victim)
        victim.spec_token_ids = []
        self.kv.free_sequence(victim)
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        # Its original arrival order puts it back at the front of its priority class.
        self.add(victim)

    def _hold_background(self, batch: ScheduledBatch) -> None:
        """Take background sequences (batch work) out of a step that has foreground work to do.

        On a compute-bound engine every sequence a step carries lengthens it. With background_yield
        "prefill" they sit out the steps that read a foreground prompt (whose first token waits for those
        steps); with "step" they sit out every step with a foreground sequence in it, so they use only
        steps that would otherwise be idle. While `background_held` they sit out every step. They keep
        their blocks and their place either way."""
        floor = self.config.background_priority
        if floor is None:
            return
        if not self.background_held:
            if self.config.background_yield == "step":
                pressing = [seq for seq, _ in batch.prefills] + batch.decodes
            else:
                pressing = [seq for seq, _ in batch.prefills] + [s for s in batch.decodes
                                                                 if s.num_computed_tokens < s.prompt_len]
            if not any(seq.priority < floor for seq in pressing):
                return
        batch.decodes = [seq for seq in batch.decodes if seq.priority < floor]
        batch.prefills = [(seq, n) for seq, n in batch.prefills if seq.priority < floor]

    def _budget(self) -> int:
        """The step's token budget: background_step_tokens when only background sequences are queued, so
        that a foreground request arriving during the step waits for a short one."""
        cfg = self.config
        floor, cap = cfg.background_priority, cfg.background_step_tokens
        if floor is None or cap is None or cap >= cfg.max_num_batched_tokens:
            return cfg.max_num_batched_tokens
        if (self.waiting and self.waiting[0].priority < floor) or any(seq.priority < floor for seq in self.running):
            return cfg.max_num_batched_tokens
        return cap

    def schedule(self) -> ScheduledBatch:
        shared = len(self.running) + len(self.waiting) > 1
        batch = self._schedule(shared)
        if (shared and not batch.decodes and not batch.prefills and not batch.preempted and self.encoder is not None
                and self.running):
            # Every sequence waits for image pieces the pacing held back: encoding them delays nobody.
            batch = self._schedule(False)
        floor = self.config.background_priority
        seqs = batch.decodes + [seq for seq, _ in batch.prefills]
        batch.background_only = floor is not None and bool(seqs) and all(seq.priority >= floor for seq in seqs)
        batch.interruptible = batch.background_only and bool(batch.decodes) and not batch.prefills and not batch.encode
        return batch

    def _schedule(self, shared: bool) -> ScheduledBatch:
        """One step's plan; `shared`: the step is shared with other requests, so encoder work is paced."""
        cfg, batch = self.config, ScheduledBatch()
        budget = self._budget()
        self.running.sort(key=_SORT_KEY)
        if self.encoder is not None:
            self.encoder.begin_step(shared)

        # 1. Running sequences: decodes (one token) and unfinished prefills, in priority order.
        i, block_size = 0, self.kv.block_size
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            if remaining == 1 and seq.num_computed_tokens < len(seq.block_table) * block_size and not seq.images:
                # A decode whose token fits the block it is writing: nothing to grow, no one to preempt
                # (most sequences, most steps: the general path below cost a fleet simulation a third).
                batch.decodes.append(seq)
                budget -= 1
                i += 1
                continue
            n = min(remaining, budget) if cfg.enable_chunked_prefill or remaining == 1 else remaining
            if n > budget:
                break
            if seq.images and self.encoder is not None:
                n = self.encoder.fit(seq, n)
                if n == 0:  # its next image piece waits for encoder budget (and a short chunk for it)
                    i += 1
                    continue
            # Grow the block table; when the pool is full, preempt the lowest-priority, newest.
            while not self.kv.can_grow(seq, seq.num_computed_tokens + n):
                if self.reclaim(seq):
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted itself; the list shifted under i
            self.kv.grow(seq, seq.num_computed_tokens + n)
            if remaining == 1:
                batch.decodes.append(seq)
            else:
                batch.prefills.append((seq, n))
            budget -= n
            i += 1

        # 2. Waiting sequences, strictly in order, while budget, sequence slots and blocks allow.
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            fits = self.kv.can_allocate(seq)
            while not fits and self.reclaim(seq):
                fits = self.kv.can_allocate(seq)
            if not fits:
                break
            self.kv.allocate(seq)
            remaining = len(seq) - seq.num_computed_tokens
            if not cfg.enable_chunked_prefill and remaining > budget:
                if batch:  # a whole prompt must wait for an empty step
                    self.kv.free_sequence(seq)
                    break
                n = remaining
            else:
                n = min(remaining, budget)
            if seq.images and self.encoder is not None:
                n = self.encoder.fit(seq, n)
                if n == 0 and not self.encoder.planned_for(seq) and not self.encoder.held_short:
                    self.encoder.forget(seq)
                    self.kv.free_sequence(seq)
                    break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if n == 0:  # admitted for a slice of its image's encoder work, or to wait for it: nothing read yet
                continue
            if remaining == 1:
                batch.decodes.append(seq)
            else:
                batch.prefills.append((seq, n))
            budget -= n

        self._hold_background(batch)
        if self.encoder is not None:
            batch.encode = self.encoder.take_plan()

        # 3. Proposed tokens (speculative decoding) take only what is left: they never delay
        # a prefill nor cause a preemption, and never run past the context window.
        for seq in batch.decodes:
            if not seq.spec_token_ids:
                continue
            k = min(len(seq.spec_token_ids), budget, cfg.max_model_len - len(seq))
            while k > 0 and not self.kv.can_grow(seq, len(seq) + k):
                k -= 1
            del seq.spec_token_ids[max(k, 0):]
            if k > 0:
                self.kv.grow(seq, len(seq) + k)
                budget -= k
        return batch
