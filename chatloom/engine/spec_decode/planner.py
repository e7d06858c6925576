"""How many tokens to propose for each sequence this step, or none at all.

Checking k extra tokens is almost free while a step is bound by reading the weights
(batch 1 on a CPU) and costs nearly their full price once the batch is large enough to
be bound by arithmetic. So the plan weighs, per step, what each extra token is expected
to bring against what it is measured to cost:

- a sequence whose proposals are kept at rate a yields its j-th proposed token with
  probability a^j (it is used only if all before it were kept);
- a step over n tokens takes t(n) seconds, measured (CostModel: timed forwards at
  start-up, refreshed by every decode-only step that follows); a draft model adds
  its own forwards, one per proposed position.

The plan adds proposed tokens in order of expected value while tokens per second go up
and stops where the next would lower it: with a big batch or a poor acceptance rate
that is at zero tokens, which switches speculation off for the step.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field


class CostModel:
    """Seconds for one forward over n tokens: per-n moving averages, linear in between
    and beyond the largest n seen."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self._ns: list[int] = []
        self._t: dict[int, float] = {}

    @property
    def calibrated(self) -> bool:
        return len(self._ns) >= 2

    def observe(self, n: int, seconds: float) -> None:
        if n <= 0 or seconds <= 0:
            return
        old = self._t.get(n)
        if old is None:
            bisect.insort(self._ns, n)
            self._t[n] = seconds
        else:
            # Cap a single outlier (a shared machine stalls now and then) at twice the average.
            self._t[n] = old + self.smoothing * (min(seconds, 2 * old) - old)

    def seconds(self, n: int) -> float:
        """Interpolated, and never above what any larger n measured: a stall on a shared
        machine makes one point too slow, never too fast."""
        ns, t = self._ns, self._t
        if not ns:
            return float(n)  # uncalibrated: cost proportional to tokens (no speculation pays)
        i = bisect.bisect_left(ns, n)
        later = min((t[m] for m in ns[i:]), default=float("inf"))
        return min(self._interpolate(n), later)

    def _interpolate(self, n: int) -> float:
        ns, t = self._ns, self._t
        if n in t:
            return t[n]
        i = bisect.bisect(ns, n)
        if i == 0:
            return t[ns[0]]
        if i == len(ns):
            if len(ns) == 1:
                return t[ns[0]] * n / ns[0]
            a, b = ns[-2], ns[-1]
        else:
            a, b = ns[i - 1], ns[i]
        slope = max(0.0, (t[b] - t[a]) / (b - a))
        return t[a] + slope * (n - a)


@dataclass
class AcceptanceTracker:
    """Rate at which proposals are kept, as decaying ratios of kept to tried positions (a
    position is tried when every proposal before it was kept), per proposal source (for
    n-gram lookup, the match length: a long match is kept far more often than a short one):
    engine-wide, and per sequence. A sequence's estimate starts from the engine-wide rate of
    the source at hand and moves with its own record for that source."""

    prior: float = 0.5
    decay: float = 0.8
    _seq: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)  # id -> source -> (kept, tried)
    _source: dict[int, tuple[float, float]] = field(default_factory=dict)  # source -> (kept, tried)
    _all: tuple[float, float] = (0.0, 0.0)

    def record(self, request_id: str, proposed: int, kept: int, source: int = 0) -> None:
        if proposed <= 0:
            return
        tried = kept + (1 if kept < proposed else 0)
        mine = self._seq.setdefault(request_id, {})
        s, t = mine.get(source, (0.0, 0.0))
        mine[source] = (self.decay * s + kept, self.decay * t + tried)
        s, t = self._source.get(source, (0.0, 0.0))
        self._source[source] = (0.98 * s + kept, 0.98 * t + tried)
        s, t = self._all
        self._all = (0.98 * s + kept, 0.98 * t + tried)

    def rate(self, request_id: str, source: int = 0) -> float:
        kept, tried = self._seq.get(request_id, {}).get(source, (0.0, 0.0))
        gs, gt = self._all
        base = gs / gt if gt > 0 else self.prior
        ss, st = self._source.get(source, (0.0, 0.0))
        if st >= 4:  # enough history for this source to speak for itself
            base = ss / st
        # Two pseudo-tries at the source's rate keep one unlucky step from ruling a sequence out.
        return min(0.99, (kept + 2 * base) / (tried + 2))

    def forget(self, request_id: str) -> None:
        self._seq.pop(request_id, None)


def plan_lengths(rates: list[float], available: list[int], target: CostModel, draft: CostModel | None = None,
                 min_gain: float = 1.02) -> list[int]:
    """Proposed tokens per sequence (at most available[i]) that maximize expected tokens
    per second of a decode step over len(rates) sequences; all zeros when none beats
    plain decoding by `min_gain`."""
    batch = len(rates)
    ks = [0] * batch
    if batch == 0:
        return ks
    candidates = sorted(((rates[i] ** j, i, j) for i in range(batch) for j in range(1, available[i] + 1)
                         if rates[i] > 0), reverse=True)
    base_rate = batch / target.seconds(batch)
    best_rate, best_m = base_rate * min_gain, 0
    gain, draft_seconds = 0.0, 0.0
    depth_counts: list[int] = []  # sequences drafting at least d+1 tokens
    chosen: list[tuple[int, int]] = []
    for m, (value, i, j) in enumerate(candidates, 1):
        gain += value
        chosen.append((i, j))
        if draft is not None:
            if len(depth_counts) < j:
                depth_counts.append(0)
            depth_counts[j - 1] += 1
            c = depth_counts[j - 1]
            draft_seconds += draft.seconds(c) - (draft.seconds(c - 1) if c > 1 else 0.0)
        rate = (batch + gain) / (target.seconds(batch + m) + draft_seconds)
        if rate > best_rate:
            best_rate, best_m = rate, m
    for i, j in chosen[:best_m]:
        ks[i] = max(ks[i], j)
    return ks
