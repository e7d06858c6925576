"""A sequence's KV blocks while its answer waits for a tool: held (pinned) or evicted, and adopted on resume.

When a round of generation ends in tool calls, the caller's next request repeats the prompt plus the
tool results. Two ways to serve it:

- evict: the finished sequence frees its blocks at once; its full blocks stay in the prefix cache
  until LRU hands them out, and the resume re-prefills whatever was lost (always its partial last block);
- hold: the blocks (full and the partial last one) stay referenced under a handle (the round's request
  id) until the resume request adopts them, so only the tool results' tokens are prefilled.

A round asks for this with `SamplingParams.keep_kv`: when it finishes, its blocks are kept for a short
grace (KEEP_GRACE_S) until the caller says what it wants (`decide`: hold, evict or auto) or lets go
(`release`). The resume request names the handle in `SamplingParams.resume_of`.

`auto` weighs what each choice costs. Evicted, the blocks join the back of the free list; the pool hands
out blocks from its front, so they are lost (and the resume computes them again) when the pool hands out
more blocks during the call than are free ahead of them. Held, they keep no request out, because a hold
gives way to any request short of blocks (below); what they cost the others is the prefix cache's oldest
free blocks, handed out that much sooner. So `auto` holds when the blocks would be lost:

    long_s > SURVIVAL * free_blocks / handout_rate

and evicts when they would survive in the prefix cache anyway (the hold would buy nothing and keep memory
idle), when the tool is expected to outlast the hold's timeout, or when waiting requests need more blocks
than releasing every hold would give (they would take the blocks at once). free_blocks is counted while
the round's blocks are held, and handout_rate is how many blocks the pool has handed out per second over
the last RATE_WINDOW_S. The tools' times are learned per tool name by the engine itself (the time from the
caller's decision to its resume request, both stamped when the caller made them): expected_s is an
exponentially weighted mean (weight EWMA_WEIGHT on the newest) starting from PRIOR_S, and long_s adds
LONG_DEVIATIONS weighted mean absolute deviations, so a tool whose calls take 0.2 s or 5 s is judged by
its long calls (a call that outlasts the cache costs a re-prefill).

A held sequence never keeps another request out: when a waiting request cannot get blocks, or a running
one would be preempted, holds are released first (`reclaim`, the one expected to wait longest first),
whatever the policy; a hold also ends at its timeout, or when its request is aborted. This is how a hold
under `auto` ends when memory gets tight mid-call: on demand, not by a forecast of the demand.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from chatloom.engine.held_rounds import Held, common_prefix
from chatloom.engine.kv_cache_manager import KVCacheManager
from chatloom.engine.sequence import Sequence

POLICIES = ("hold", "evict", "auto")
KEEP_GRACE_S = 5.0  # a kept round whose caller never decides is freed after this
PRIOR_S = 2.0  # expected duration of a tool never seen
EWMA_WEIGHT = 0.3  # weight of the newest observed duration
RATE_WINDOW_S = 10.0  # the free list's turnover is measured over this long
LONG_DEVIATIONS = 2.0  # a tool's long calls: its mean plus this many mean absolute deviations
SURVIVAL = 0.25  # the share of the free list's turnover time a tool may take with the blocks safe in the cache
_REMEMBERED = 1024  # evicted rounds whose tokens are remembered, to count what their resume re-prefills


@dataclass
class HoldStats:
    """The hold counters, as /metrics shows them."""

    holds: int = 0  # rounds held under a handle while their tools ran
    evictions: int = 0  # rounds whose blocks were freed when their tools started
    pressure_releases: int = 0  # holds released because another request needed the blocks
    timeouts: int = 0  # holds released at their timeout
    adopted: int = 0  # resumes that took their held blocks
    resumes: int = 0  # resume requests seen
    reprefilled_tokens: int = 0  # tokens a resume computed again that its round had computed already
    block_seconds: float = 0.0  # blocks held x seconds, for holds that have ended
    blocks_held: int = 0  # now
    held_sequences: int = 0  # now


@dataclass
class ToolTimes:
    """Expected duration of each tool: an exponentially weighted mean of observed ones, from a prior, and
    how far they stray from it (an exponentially weighted mean absolute deviation)."""

    prior_s: float = PRIOR_S
    weight: float = EWMA_WEIGHT
    means: dict[str, float] = field(default_factory=dict)
    deviations: dict[str, float] = field(default_factory=dict)

    def expected(self, tools: tuple[str, ...]) -> float:
        """A round's calls run one after another: their expected times add up."""
        return sum(self.means.get(t, self.prior_s) for t in tools) if tools else self.prior_s

    def long(self, tools: tuple[str, ...]) -> float:
        """A duration the round's calls seldom pass: the mean plus LONG_DEVIATIONS deviations. A tool whose
        durations spread widely (a search that takes 0.2 s or 5 s) is judged by its long calls, since a
        call that outlasts the cache costs a whole re-prefill."""
        spread = sum(self.deviations.get(t, 0.0) for t in tools)
        return self.expected(tools) + LONG_DEVIATIONS * spread

    def observe(self, tools: tuple[str, ...], seconds: float) -> None:
        """A round's duration, shared among its tools in proportion to what each was expected to take."""
        if not tools:
            return
        total = self.expected(tools)
        for t in tools:
            share = seconds * self.means.get(t, self.prior_s) / total
            old = self.means.get(t)
            if old is None:
                self.means[t], self.deviations[t] = share, 0.0
                continue
            self.means[t] = old + self.weight * (share - old)
            dev = self.deviations.get(t, 0.0)
            self.deviations[t] = dev + self.weight * (abs(share - old) - dev)


class KVHolds:
    """The kept rounds of one engine, by handle."""

    def __init__(self, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.clock = clock
        self.held: dict[str, Held] = {}
        self.times = ToolTimes()
        self.stats = HoldStats()
        self._evicted: OrderedDict[str, tuple[list[int], float, tuple[str, ...]]] = OrderedDict()
        self._handouts: deque[tuple[float, int]] = deque()  # (time, blocks handed out by then), recent

    # -- a round ends -----------------------------------------------------------------
    def keep(self, seq: Sequence) -> bool:
        """Take the blocks of a finished sequence that asked to be kept; False: it cannot be (the caller
        frees it as usual)."""
        if seq.num_released_blocks or seq.images or seq.index or not seq.block_table:
            return False
        computed = seq.num_computed_tokens
        self.kv.trim(seq, computed)  # blocks beyond the computed tokens hold nothing
        now = self.clock()
        self.held[seq.request_id] = Held(seq.request_id, list(seq.cache_token_ids[:computed]), seq.block_table,
                                         seq.num_hashed_blocks, now, now + KEEP_GRACE_S)
        seq.block_table, seq.num_computed_tokens, seq.num_hashed_blocks = [], 0, 0
        self._refresh()
        return True

    def pressure(self, waiting: list[Sequence]) -> bool:
        """Whether waiting requests need more blocks than releasing every hold would make free."""
        need = sum(self.kv.blocks_needed(len(s) - s.num_computed_tokens) for s in waiting)
        return need > self.kv.num_free_blocks + self.stats.blocks_held

    def handout_rate(self) -> float:
        """Blocks the pool handed out per second, recently."""
        now, count = self.clock(), self.kv.pool.handed_out
        samples = self._handouts
        if not samples or now - samples[-1][0] >= 0.1:
            samples.append((now, count))
        while len(samples) > 1 and samples[0][0] < now - RATE_WINDOW_S:
            samples.popleft()
        span = now - samples[0][0]
        return (count - samples[0][1]) / span if span > 0 else 0.0

    def cache_keeps(self, expected_s: float) -> bool:
        """Whether blocks freed now would most likely still be in the prefix cache after `expected_s`."""
        rate = self.handout_rate()
        return rate <= 0 or expected_s <= SURVIVAL * self.kv.num_free_blocks / rate

    def decide(self, handle: str, tools: list[str], policy: str, timeout_s: float,
               waiting: list[Sequence], asked_at: float | None = None) -> str:
        """The round under `handle` ended in calls to `tools`: hold its blocks (until adopted, released or
        `timeout_s`) or evict them, as `policy` says. Returns "hold", "evict", or "gone" (nothing kept).
        `asked_at`: when the caller said so (on this clock), if before now: the tools' time runs from it."""
        if policy not in POLICIES:
            raise ValueError(f"unknown KV policy {policy!r}: use {', '.join(POLICIES)}")
        found = self.held.get(handle)
        names = tuple(tools)
        expected = self.times.expected(names)
        if found is None:
            return "gone"
        now = self.clock()
        found.tools, found.expected_s, found.since = names, expected, now
        found.asked = now if asked_at is None else asked_at
        auto = policy == "auto" and self.worth_holding(expected, self.times.long(names), timeout_s, waiting)
        hold = policy == "hold" or auto
        if not hold:
            self.stats.evictions += 1
            self._drop(found)
            return "evict"
        self.stats.holds += 1
        found.decided, found.deadline = True, now + timeout_s
        return "hold"

    def worth_holding(self, expected_s: float, long_s: float, timeout_s: float, waiting: list[Sequence]) -> bool:
        """auto's rule: hold what the prefix cache would lose during a long call (`long_s`; the mean
        `expected_s` decides whether the hold outlasts its timeout), unless the tool is expected to
        outlast the hold or waiting requests need the blocks now. A full pool is no reason to evict: a
        hold gives way to any request short of blocks (reclaim), so until one comes it keeps nobody out."""
        return (expected_s < timeout_s and not self.pressure(waiting)
                and not self.cache_keeps(long_s))

    # -- the resume -------------------------------------------------------------------------
    def take(self, seq: Sequence) -> Held | None:
        """The kept round `seq` resumes, handed over (the caller adopts its blocks), or None."""
        found = self.held.pop(seq.params.resume_of, None)
        if found is not None:
            self._ended(found)
            self.stats.adopted += 1
        return found

    def resumed(self, seq: Sequence, computed_before: list[int] | None, cached: int) -> None:
        """`seq`, a resume, now holds `cached` of its tokens without computing them: count what it computes
        again of the `computed_before` tokens its round had (None: not remembered)."""
        self.stats.resumes += 1
        if computed_before is not None:
            common = common_prefix(computed_before, seq.cache_token_ids)
            self.stats.reprefilled_tokens += max(0, min(common, len(seq) - 1) - cached)

    def forget_evicted(self, handle: str) -> list[int] | None:
        """The tokens an evicted round had computed, once (its resume is counted against them)."""
        found = self._evicted.pop(handle, None)
        return None if found is None else found[0]

    def resume_asked(self, handle: str, at: float) -> None:
        """The resume of the round `handle` was asked for at `at` (on this clock): its tools took from the
        decision until then. Both times are the caller's, not when the engine got to them between two
        steps, or a tool shorter than a step would count as taking no time at all."""
        found = self.held.get(handle)
        if found is not None and found.decided and found.tools:
            tools, asked = found.tools, found.asked
        elif handle in self._evicted:
            _, asked, tools = self._evicted[handle]
        else:
            return
        if tools:
            self.times.observe(tools, max(0.0, at - asked))

    # -- letting go -----------------------------------------------------------------------
    def release(self, handle: str) -> bool:
        """Free a kept round now (its answer ended, or was stopped); False if none is kept."""
        found = self.held.get(handle)
        if found is None:
            self._evicted.pop(handle, None)
            return False
        self._drop(found, remember=False)
        return True

    def expire(self) -> None:
        self.handout_rate()  # sampled every step, so the rate is known when a round ends
        now = self.clock()
        for found in [h for h in self.held.values() if h.deadline <= now]:
            if found.decided:
                self.stats.timeouts += 1
            self._drop(found)

    def reclaim(self, keep: str | None = None) -> bool:
        """Release the hold expected to wait longest (not `keep`), because another request needs blocks;
        False when there is none."""
        candidates = [h for h in self.held.values() if h.handle != keep]
        if not candidates:
            return False
        victim = max(candidates, key=lambda h: (h.since + h.expected_s, len(h.block_table)))
        self.stats.pressure_releases += 1
        self._drop(victim)
        return True

    def _drop(self, found: Held, remember: bool = True) -> None:
        del self.held[found.handle]
        self._ended(found)
        # Full blocks stay in the prefix cache (LRU); the partial last one goes first.
        self.kv.pool.release(reversed(found.block_table))
        if remember:  # the tools' time runs on from the decision: the resume's request observes it
            self._evicted[found.handle] = (found.token_ids, found.asked, found.tools)
            while len(self._evicted) > _REMEMBERED:
                self._evicted.popitem(last=False)

    def _ended(self, found: Held) -> None:
        now = self.clock()
        if found.decided:
            self.stats.block_seconds += len(found.block_table) * (now - found.since)
        self._refresh()

    def _refresh(self) -> None:
        self.stats.held_sequences = len(self.held)
        self.stats.blocks_held = sum(len(h.block_table) for h in self.held.values())

    def snapshot(self) -> HoldStats:
        """The counters now, with the block-seconds of the holds still running."""
        now = self.clock()
        live = sum(len(h.block_table) * (now - h.since) for h in self.held.values() if h.decided)
        s = self.stats
        return HoldStats(s.holds, s.evictions, s.pressure_releases, s.timeouts, s.adopted, s.resumes,
                         s.reprefilled_tokens, s.block_seconds + live, s.blocks_held, s.held_sequences)
