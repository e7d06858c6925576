"""When a probe's run may end before its traffic has: once what the probe asks is known.

A planner's probe asks one of two things of a run: does the fleet meet the SLO (the verdict), or
what share of the prompt tokens came from the prefix cache (the hit rate). Both can be known well
before the last answer has streamed, and the requests still streaming are the costliest part of
the run. `EarlyStop` names the SLO and the measured window; `Tally` counts the window's requests
as the run goes and says when the answer is known.
"""
from __future__ import annotations

from dataclasses import dataclass

from chatloom.sim.replica import SimRequest


@dataclass(frozen=True)
class EarlyStop:
    """Stop a run once more requests arriving in [start_s, end_s) have missed the SLO (refused, or
    their TTFT or TPOT over the target) than `misses`: it certainly misses, and an overloaded fleet is
    the costliest to simulate further. With `meets` (an attainment), also once it certainly meets that
    share: after the window's last arrival, every request of the window has its first token, none was
    refused, and even if every answer still streaming missed, the share would hold (and the miss
    budget would not be spent). With `first_tokens`, also once every request of the window has its
    first token or was refused: its cached tokens are fixed then, so the window's prefix hit rate is
    known."""

    ttft_s: float
    tpot_s: float
    start_s: float
    end_s: float
    misses: int
    meets: float | None = None
    first_tokens: bool = False

    def in_window(self, r: SimRequest) -> bool:
        return self.start_s <= r.arrival < self.end_s

    def missed(self, r: SimRequest) -> bool:
        if not self.start_s <= r.arrival < self.end_s:
            return False
        if r.finished is None or r.first_token is None:
            return True
        n = len(r.answer)
        slow_stream = n > 1 and (r.finished - r.first_token) / (n - 1) > self.tpot_s
        return r.first_token - r.arrival > self.ttft_s or slow_stream


class Tally:
    """The window's requests so far, counted as they are sent, get their first token and end."""

    __slots__ = ("rule", "sent", "first", "good", "missed", "refused", "reason")

    def __init__(self, rule: EarlyStop) -> None:
        self.rule = rule
        self.sent = 0      # arrived in the window
        self.first = 0     # of those, with their first token
        self.good = 0      # ended within the SLO
        self.missed = 0    # ended outside it, refusals included
        self.refused = 0
        self.reason = ""   # why the run may stop: "missed", "meets" or "first tokens"; "" while it may not

    def sent_one(self, r: SimRequest) -> None:
        if self.rule.in_window(r):
            self.sent += 1

    def first_token(self, r: SimRequest, now: float) -> None:
        if self.rule.in_window(r):
            self.first += 1
            self._check(now)

    def ended(self, r: SimRequest, now: float) -> None:
        rule = self.rule
        if rule.in_window(r):
            if r.refused is not None:
                self.refused += 1
            if rule.missed(r):
                self.missed += 1
                if self.missed > rule.misses:
                    self.reason = "missed"
                    return
            else:
                self.good += 1
        self._check(now)

    def _check(self, now: float) -> None:
        rule = self.rule
        if now < rule.end_s or self.reason:
            return  # the window's arrivals are not all in yet
        waiting = self.sent - self.first - self.refused  # no first token yet, and still may be refused
        if waiting:
            return
        if rule.first_tokens:
            self.reason = "first tokens"
        elif (rule.meets is not None and self.sent and not self.refused and self.sent - self.good <= rule.misses
              and round(self.good / self.sent, 4) >= rule.meets):
            self.reason = "meets"
