"""How many replicas the fleet needs a start-up time from now: a forecast of arrivals turned into replicas.

`ArrivalForecast` is additive Holt-Winters over arrival counts per interval: a level, a trend and a
daily season (one slot per interval of the day), each smoothed exponentially. The season needs a day
of history; until then the forecast is level plus trend.

`PredictiveAutoscaler` sizes the fleet for the highest forecast rate between now and one start-up
time ahead (a replica asked for now is ready only then), with headroom, from the requests per second
one replica serves within its SLO (the caller derives that from the fitted step-time model, or
measures it). It scales up at once; it scales down only after the need has stayed lower for
`scale_down_hold_s`, then by at most `scale_down_share` of the fleet an interval, so a short lull
does not drain replicas the next minutes need.
`ReactiveAutoscaler` is the usual alternative, kept to compare against: it adds a replica when the
queue wait passes a threshold and removes one when utilization is low.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ArrivalForecast:
    interval_s: float = 60.0
    season_s: float = 86400.0
    alpha: float = 0.3   # level
    beta: float = 0.1    # trend
    gamma: float = 0.2   # season
    level: float | None = None
    trend: float = 0.0
    seen: int = 0  # intervals observed
    season: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.season_s < self.interval_s:
            raise ValueError("the forecast needs a positive interval no longer than its season")
        self.period = max(1, round(self.season_s / self.interval_s))
        if not self.season:
            self.season = [0.0] * self.period

    @property
    def seasonal(self) -> bool:
        """Whether a whole season has been seen (before that the season terms stay out)."""
        return self.seen >= self.period

    def observe(self, arrivals: float) -> None:
        """Arrivals counted over the interval that just ended."""
        slot = self.seen % self.period
        s = self.season[slot] if self.seasonal else 0.0
        if self.level is None:
            self.level = arrivals
        else:
            previous = self.level
            self.level = self.alpha * (arrivals - s) + (1 - self.alpha) * (self.level + self.trend)
            self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend
        if self.seen < self.period:  # the first season: keep it whole, to start the season terms from
            self.season[slot] = arrivals
        else:
            self.season[slot] = self.gamma * (arrivals - self.level) + (1 - self.gamma) * s
        self.seen += 1
        if self.seen == self.period:  # each slot's offset from the season's mean; the level is that mean
            mean = sum(self.season) / self.period
            self.season = [v - mean for v in self.season]
            self.level, self.trend = mean, 0.0

    def forecast(self, ahead: int) -> float:
        """Arrivals expected in the interval `ahead` intervals after the next one starts (0: the next)."""
        if self.level is None:
            return 0.0
        s = self.season[(self.seen + ahead) % self.period] if self.seasonal else 0.0
        return max(0.0, self.level + (ahead + 1) * self.trend + s)


@dataclass(frozen=True)
class AutoscaleConfig:
    min_replicas: int
    max_replicas: int
    capacity_rps: float           # requests per second one replica serves within its SLO
    startup_s: float              # from asking for a replica to its first answer
    interval_s: float = 60.0
    headroom: float = 1.2         # provision this much above the forecast (bursts, forecast error)
    scale_down_hold_s: float = 600.0
    scale_down_share: float = 0.05  # of the fleet, at most, drained per interval once the hold is over

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"autoscaling needs 1 <= min ({self.min_replicas}) <= max ({self.max_replicas})")
        if self.capacity_rps <= 0 or self.startup_s < 0 or self.interval_s <= 0 or self.headroom < 1:
            raise ValueError("autoscaling needs a positive capacity and interval, a start-up time >= 0 and "
                             "headroom >= 1")

    def replicas_for(self, rate_rps: float) -> int:
        need = math.ceil(rate_rps * self.headroom / self.capacity_rps - 1e-9)
        return min(self.max_replicas, max(self.min_replicas, need))


class PredictiveAutoscaler:
    def __init__(self, config: AutoscaleConfig, forecast: ArrivalForecast | None = None) -> None:
        self.config = config
        self.forecast = forecast or ArrivalForecast(interval_s=config.interval_s)
        self.desired = config.min_replicas
        self.expected_rps = 0.0
        self._lower_since: float | None = None

    def step(self, arrivals: float, now: float) -> int:
        """Feed the interval's arrivals; the replicas wanted from now on."""
        c = self.config
        self.forecast.observe(arrivals)
        lead = math.ceil(c.startup_s / c.interval_s)
        peak = max(self.forecast.forecast(h) for h in range(lead + 1))
        self.expected_rps = max(peak, arrivals) / c.interval_s
        need = c.replicas_for(self.expected_rps)
        if need >= self.desired:
            self.desired, self._lower_since = need, None
        elif self._lower_since is None:
            self._lower_since = now
        elif now - self._lower_since >= c.scale_down_hold_s:
            # Down in steps of at most scale_down_share of the fleet an interval, so a forecast that
            # dips for one interval drains only a few replicas (each finishes its answers first).
            self.desired = max(need, self.desired - max(1, math.floor(self.desired * c.scale_down_share)))
        return self.desired


class ReactiveAutoscaler:
    """Adds a replica while the queue wait is above `queue_wait_s`; removes one when utilization has
    stayed below `low_utilization` for the hold."""

    def __init__(self, config: AutoscaleConfig, queue_wait_s: float = 1.0, low_utilization: float = 0.5) -> None:
        self.config = config
        self.queue_wait_s = queue_wait_s
        self.low_utilization = low_utilization
        self.desired = config.min_replicas
        self._low_since: float | None = None

    def step(self, queue_wait_s: float, utilization: float, now: float) -> int:
        c = self.config
        if queue_wait_s > self.queue_wait_s:
            self.desired = min(c.max_replicas, self.desired + 1)
            self._low_since = None
        elif utilization < self.low_utilization and self.desired > c.min_replicas:
            if self._low_since is None:
                self._low_since = now
            elif now - self._low_since >= c.scale_down_hold_s:
                self.desired -= 1
                self._low_since = now
        else:
            self._low_since = None
        return self.desired
