"""One simulated engine replica: the engine's real Scheduler and KV-cache manager, no model.

A step goes as in LLMEngine.step: the Scheduler plans a batch, the step takes the time the step-time
model gives, then the planned tokens count as computed, each sequence whose prompt is complete gets
its next token (the answer the traffic model drew), finished sequences leave, and full blocks are
published in the prefix cache. Only the forward pass and the sampler are replaced.

Fast-forward: when a plan is pure decode and the next plans are bound to be the same (no prefill in
flight, nothing the scheduler could admit, no sequence finishing, blocks to spare), k identical steps
are taken as one event, their durations from `StepTimeModel.decode_run`. The blocks the scheduler
would have grown step by step are grown at the end of the run, after checking up front that the pool
holds them, so no preemption is skipped. An arrival cuts a run short at the step in flight.
"""
from __future__ import annotations

import random
import zlib
from collections import deque
from dataclasses import dataclass

from chatloom.engine.block_pool import BlockPool
from chatloom.engine.scheduler_config import SchedulerConfig
from chatloom.engine.kv_cache_manager import KVCacheManager
from chatloom.engine.sampling_params import SamplingParams
from chatloom.engine.scheduler import ScheduledBatch, Scheduler
from chatloom.engine.sequence import Sequence, SequenceStatus
from chatloom.sim.hardware import ReplicaSpec
from chatloom.sim.step_time import shape_of

MAX_RUN_STEPS = 64  # longest fast-forward; bounds how stale the router's view of a replica gets


@dataclass(eq=False)
class SimRequest:
    """A request's life in simulated time (seconds)."""

    rid: str
    arrival: float
    prompt: list[int]
    answer: list[int]
    priority: int = 0
    tier: str = ""
    reasoning: bool = False
    conversation: object = None
    block_keys: tuple[int, ...] = ()
    replica: str = ""
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    refused: str | None = None
    cached_tokens: int = 0
    preemptions: int = 0
    # Disaggregation: the KV arrives from a prefill replica; only the decode remains.
    kv_ready: bool = False
    # Answering when the run began (a snapshot start): placed in a batch, not routed nor transferred.
    under_way: bool = False
    # When it was routed (the TTFT estimate's inputs): requests queued on its replica, tokens to prefill there.
    waiting_at_route: int = 0
    prefill_at_route: int = 0

    @property
    def output_tokens(self) -> int:
        return len(self.answer)


def sim_block_key(parent: int, tokens: tuple[int, ...]) -> int:
    """A full block's key in the simulator: hash(parent key, its token ids), as the engine's, with
    Python's own hash of the tuple instead of blake2b. The engine's keys must agree across processes
    (a router and its replicas); the simulator's live in one, where ints and tuples of ints hash the
    same in every run (no salt), so runs stay reproducible. Only equality of keys matters (the pool
    also checks a cached block's tokens), and a 64-bit hash of the tuple costs less than looking a
    digest up in a memo: block keys were a third of a probe's time."""
    return hash((parent, tokens))


def sim_prefix_keys(token_ids: list[int], block_size: int, root: int) -> list[int]:
    """The keys of every full block of `token_ids` (block_hash.prefix_block_keys, with sim_block_key)."""
    keys, parent = [], root
    for i in range(len(token_ids) // block_size):
        parent = sim_block_key(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        keys.append(parent)
    return keys


def _no_kv_to_copy(src: int, dst: int, n: int) -> None:
    pass


class SimBlockPool(BlockPool):
    """The engine's BlockPool, with the simulator's block keys (the only method replaced: speed)."""

    def block_key(self, parent: int, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))  # sim_block_key, inlined: it runs for every block


class _WholeBlockPool(SimBlockPool):
    """No index of cached blocks by their first tokens: only whole cached blocks are reused."""

    def _index_starts(self, block) -> None:
        pass

    def _unindex_starts(self, block) -> None:
        pass


class SimReplica:
    def __init__(self, name: str, spec: ReplicaSpec, enable_prefix_caching: bool = True,
                 partial_hits: bool = True) -> None:
        self.name = name
        self.spec = spec
        # No K/V to copy, but the same reuse of part of a cached block as the engine's, so the same
        # tokens are left to compute; or none (partial_hits False): indexing every cached block's first
        # tokens costs more than a third of a run, for hits the conversation traffic hardly has.
        pool = (SimBlockPool if partial_hits else _WholeBlockPool)(spec.num_blocks, spec.block_size, spec.model_key,
                                                                   enable_prefix_caching)
        self.kv = KVCacheManager(pool, copy_prefix=_no_kv_to_copy if partial_hits else None)
        self.sched = Scheduler(SchedulerConfig(max_num_batched_tokens=spec.max_num_batched_tokens,
                                               max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len,
                                               enable_chunked_prefill=True, background_priority=None,
                                               background_yield="prefill", background_step_tokens=None),
                               self.kv)
        self.model = spec.step_time
        # Each step's factor on the model's time (its spread, where the model has one), drawn from a
        # stream of this replica's own so a run repeats exactly.
        self._rng = random.Random(zlib.crc32(name.encode()))
        self.requests: dict[Sequence, SimRequest] = {}
        self.busy = False
        self.version = 0  # bumps when a planned step end is replaced (stale heap events are skipped)
        # The step (or run of steps) in flight.
        self._batch: ScheduledBatch | None = None
        self._run_ends: list[float] = []  # end time of each step of a run (one entry: a single step)
        self._run_start = 0.0
        # Accounting.
        self.steps = 0
        self.busy_time = 0.0
        self.usage_time = 0.0   # integral of KV usage over time
        self.peak_usage = 0.0
        self.tokens_generated = 0
        self.on_finish = None  # callback(SimRequest, now)
        self.on_first_token = None  # callback(SimRequest, now) -> bool: True stops the request (disagg)
        self.max_blocks_held = 0
        self.inbox: deque[SimRequest] = deque()  # disaggregation: KV arrived, waiting for room

    # -- the router's view ----------------------------------------------------------------
    def cached_prefix_blocks(self, keys: tuple[int, ...]) -> int:
        """How many of `keys` (a prompt's leading full blocks) this replica's prefix cache holds."""
        cached = self.kv.pool.cached
        n = 0
        for k in keys:
            if k not in cached:
                break
            n += 1
        return n

    # -- requests ---------------------------------------------------------------------------
    def add(self, req: SimRequest, now: float) -> Sequence:
        params = SamplingParams(max_tokens=len(req.answer), temperature=0, ignore_eos=True)
        seq = Sequence(req.rid, req.prompt, params, req.priority)
        seq.metrics.arrival_time = now
        self.requests[seq] = req
        req.replica = self.name
        self.sched.add(seq)
        return seq

    @property
    def num_queued(self) -> int:
        return len(self.sched.waiting) + len(self.inbox)

    def _take_inbox(self, now: float) -> None:
        while self.inbox and self.receive(self.inbox[0], now):
            self.inbox.popleft()

    def receive(self, req: SimRequest, now: float) -> bool:
        """Disaggregation: take a request whose prompt KV arrives from a prefill replica, its first token
        already made. Its blocks are allocated (reusing any this replica has cached) and it joins the
        running sequences as a decode, as a KV-connector load does; False when no slot or blocks.
        Only between steps (start() calls it for the inbox): a step in flight owns its plan's blocks."""
        sched, kv = self.sched, self.kv
        if len(sched.running) >= sched.config.max_num_seqs:
            return False
        params = SamplingParams(max_tokens=len(req.answer), temperature=0, ignore_eos=True)
        seq = Sequence(req.rid, req.prompt, params, req.priority)
        seq.token_ids.append(req.answer[0])
        if not kv.can_allocate(seq):
            return False
        kv.allocate(seq)
        seq.num_computed_tokens = len(req.prompt)  # the transferred KV; the first token is decoded next
        m = seq.metrics
        m.arrival_time, m.first_scheduled_time, m.first_token_time = req.arrival, req.first_scheduled, req.first_token
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
        self.requests[seq] = req
        req.replica = self.name
        return True

    def warm(self, tokens: list[int]) -> bool:
        """Leave `tokens` in the prefix cache as if a request over them had run here and ended (the
        blocks free, most recently used, the last one evicted first). False when the pool cannot hold
        them beside what running sequences hold."""
        seq = Sequence("warm", tokens, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        kv = self.kv
        if not kv.can_allocate(seq):
            return False
        kv.allocate(seq)
        seq.num_computed_tokens = len(tokens)
        kv.register_full_blocks(seq)
        kv.free_sequence(seq)
        return True

    def abort(self, seq: Sequence) -> SimRequest:
        req = self.requests.pop(seq)
        self.sched.remove(seq)
        seq.status = SequenceStatus.FINISHED
        return req

    def expire_waiting(self, now: float, timeout_s: float) -> list[SimRequest]:
        """Requests that waited past the admission timeout without being scheduled leave (503)."""
        gone = []
        for seq in [s for s in self.sched.waiting if s.metrics.first_scheduled_time is None
                    and now - s.metrics.arrival_time > timeout_s]:
            req = self.abort(seq)
            req.refused = "queue_timeout"
            gone.append(req)
        return gone

    # -- stepping ---------------------------------------------------------------------------
    def start(self, now: float) -> float | None:
        """Plan the next step (or run of steps); returns when it ends, None when there is nothing to do."""
        if self.inbox:
            self._take_inbox(now)
        batch = self.sched.schedule()
        if not batch:
            self.busy = False
            self._batch = None
            return None
        self.busy = True
        for seq in batch.decodes:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        for seq, _ in batch.prefills:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        self._batch = batch
        self._run_start = now
        k = self._run_length(batch)
        if k > 1:
            ctx0 = sum(s.num_computed_tokens + 1 for s in batch.decodes)
            durations = self.model.decode_run(len(batch.decodes), ctx0, k).tolist()
            factors = self.model.jitter(self._rng, k)
            t, ends = now, []
            for i, d in enumerate(durations):
                t += d if factors is None else d * factors[i]
                ends.append(t)
            self._run_ends = ends
        else:
            factor = self.model.jitter(self._rng, 1)
            d = self.model.step_time(shape_of(batch))
            self._run_ends = [now + (d if factor is None else d * factor[0])]
        return self._run_ends[-1]

    def _run_length(self, batch: ScheduledBatch) -> int:
        if batch.prefills or batch.preempted or len(batch.decodes) == 0:
            return 1
        sched, kv = self.sched, self.kv
        if sched.waiting and len(sched.running) < sched.config.max_num_seqs and \
                len(batch.decodes) < sched.config.max_num_batched_tokens and kv.can_allocate(sched.waiting[0]):
            return 1  # the next plan admits a waiting request
        k = MAX_RUN_STEPS
        max_len = sched.config.max_model_len
        for seq in batch.decodes:
            n = len(seq.token_ids)
            left = seq.params.max_tokens - n + seq.prompt_len
            if max_len - n < left:
                left = max_len - n
            if left < k:
                k = left
                if k <= 1:
                    return 1
        # Blocks the next k-1 steps grow into, all of which the pool must hold (else: a preemption).
        bs = kv.block_size
        need = 0
        for seq in batch.decodes:
            need += -(-(seq.num_computed_tokens + k) // bs) - len(seq.block_table)
        return k if need <= kv.num_free_blocks else 1

    def cut_short(self, now: float) -> float | None:
        """An arrival: end the run at the step in flight so the next plan can admit it. Returns the new
        end time if it changed."""
        ends = self._run_ends
        if len(ends) <= 1:
            return None
        for i, end in enumerate(ends):
            if end > now:
                break
        if i == len(ends) - 1:
            return None
        del ends[i + 1:]
        self.version += 1
        return ends[-1]

    def finish(self, now: float) -> None:
        """The step (or run) in flight has ended at `now`: apply its results."""
        batch, k = self._batch, len(self._run_ends)
        self._batch = None
        kv, reqs = self.kv, self.requests
        dt = now - self._run_start
        self.steps += k
        self.busy_time += dt
        self.usage_time += kv.usage * dt
        if kv.usage > self.peak_usage:
            self.peak_usage = kv.usage
        if k > 1:
            for seq in batch.decodes:
                # The later steps of the run: the scheduler would have grown these blocks one step at a time.
                kv.grow(seq, seq.num_computed_tokens + k)
                seq.num_computed_tokens += k
        completed = []
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq):
                completed.append(seq)
        held = kv.num_blocks - kv.num_free_blocks
        if held > self.max_blocks_held:
            self.max_blocks_held = held
        # Each decode's token, then, as LLMEngine.step, its full blocks published in the prefix cache
        # (skipping the call when no block filled up, which is most decode steps). Registering one
        # sequence's blocks touches no other's and no free block, so it is done sequence by sequence.
        first_end, max_len, made, bs = self._run_ends[0], self.spec.max_model_len, 0, kv.block_size
        for seq in batch.decodes:
            req, tokens = reqs[seq], seq.token_ids
            start = len(tokens) - seq.prompt_len
            if k == 1:
                seq.num_computed_tokens += 1
                tokens.append(req.answer[start])
            else:
                tokens.extend(req.answer[start:start + k])
            if start + k < seq.params.max_tokens and len(tokens) < max_len and seq.metrics.first_token_time is not None:
                made += k  # most decodes neither begin nor end their answer: only their tokens count
            else:
                if k > 1:
                    # The real engine published each block as it filled, up to the step before the last.
                    kv.register_full_blocks(seq, seq.num_computed_tokens - 1)
                self._after_tokens(seq, req, k, first_end, now)
                if seq.status is SequenceStatus.FINISHED:
                    continue
            if seq.num_computed_tokens // bs > seq.num_hashed_blocks:
                kv.register_full_blocks(seq)
        self.tokens_generated += made
        for seq in completed:
            req = reqs[seq]
            seq.token_ids.append(req.answer[seq.num_output_tokens])
            self._after_tokens(seq, req, 1, now, now)
        for seq, _ in batch.prefills:
            if seq.status is not SequenceStatus.FINISHED and seq.num_computed_tokens // bs > seq.num_hashed_blocks:
                kv.register_full_blocks(seq)

    def _after_tokens(self, seq: Sequence, req: SimRequest, got: int, first_at: float, now: float) -> None:
        self.tokens_generated += got
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = first_at
            req.first_scheduled = m.first_scheduled_time
            req.first_token = first_at
            req.cached_tokens = m.num_cached_tokens
            if self.on_first_token is not None and self.on_first_token(req, now):
                # Disaggregation: a prefill replica hands the request (and its KV) on; the prompt's
                # blocks stay in its prefix cache.
                self.kv.register_full_blocks(seq)
                self.sched.remove(seq)
                seq.status = SequenceStatus.FINISHED
                del self.requests[seq]
                return
        if seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.spec.max_model_len:
            self._finish(seq, req, now)

    def _finish(self, seq: Sequence, req: SimRequest, now: float) -> None:
        self.sched.remove(seq)
        seq.status = SequenceStatus.FINISHED
        del self.requests[seq]
        req.finished = now
        req.preemptions = seq.metrics.num_preemptions
        if self.on_finish is not None:
            self.on_finish(req, now)

    # -- checks (tests) ----------------------------------------------------------------------
    def check_kv(self) -> None:
        """KV is never over-committed: each block is held by exactly its refcount of live tables,
        free blocks are held by none, and the pool's size never changes."""
        kv = self.kv
        counts = [0] * kv.num_blocks
        for seq in list(self.sched.running) + list(self.sched.waiting):
            for b in seq.block_table:
                counts[b] += 1
        for b, blk in enumerate(kv.pool.blocks):
            assert blk.ref_count == counts[b], f"{self.name}: block {b} refcount {blk.ref_count} != {counts[b]} holders"
            assert (blk.ref_count == 0) == (b in kv.pool.free), f"{self.name}: block {b} free-list state is wrong"
        assert all(not s.block_table for s in self.sched.waiting), f"{self.name}: a waiting sequence holds blocks"
        assert len(kv.pool.free) + sum(1 for blk in kv.pool.blocks if blk.ref_count > 0) == kv.num_blocks
