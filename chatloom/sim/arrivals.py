"""Who sends what, and when: the traffic a simulated fleet serves.

New conversations arrive as a Poisson process whose rate follows the day (a cosine between a trough
and the peak) and a burst window. Each conversation has a geometric number of turns; the next turn
arrives a think time (exponential) after the previous answer finished, so a slow fleet slows its own
traffic as real users do (a closed loop per conversation). A turn's prompt is the shared system
prompt plus the newest turns that fit the context window (older ones dropped, as the product's
prompt assembly does), so consecutive turns share a long prefix: what prefix caching and
prefix-aware routing feed on. Answers are lognormal; a share of requests are reasoning requests with
long outputs. Each conversation belongs to a tier, which sets its scheduling priority.

Token ids are random but fixed per conversation, so a prefix repeated by the next turn is the same
token sequence, and the engine's block keys match exactly as they would on real text.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

DAY_S = 86400.0
TOKEN_LO, TOKEN_HI = 1000, 30000


@dataclass(frozen=True)
class SimTier:
    name: str
    share: float
    priority: int  # the scheduler's: lower runs first


DEFAULT_TIERS = (SimTier("free", 0.70, 2), SimTier("plus", 0.25, 1), SimTier("pro", 0.05, 0))


@dataclass
class TrafficModel:
    peak_rate: float                    # messages (requests) per second at the peak of the day
    diurnal_trough: float = 0.35        # lowest rate of the day as a fraction of the peak
    start_offset_s: float = 0.0         # where in the day the simulation starts (0: at the peak)
    burst_factor: float = 1.0           # rate multiplier inside the burst window
    burst_start_s: float = 0.0
    burst_duration_s: float = 0.0
    mean_turns: float = 3.0             # geometric number of turns per conversation
    think_time_s: float = 20.0          # mean pause between an answer and the next message
    system_prompt_tokens: int = 200     # shared by every conversation
    user_median_tokens: float = 80.0
    user_sigma: float = 1.0
    answer_median_tokens: float = 360.0  # lognormal; mean = median * exp(sigma^2 / 2), about 500 here
    answer_sigma: float = 0.8
    reasoning_share: float = 0.1
    reasoning_median_tokens: float = 2000.0
    reasoning_sigma: float = 0.6
    max_answer_tokens: int = 4096
    max_user_tokens: int = 4000
    tiers: tuple[SimTier, ...] = DEFAULT_TIERS
    single_prompt: list[int] | None = field(default=None, repr=False)  # (validation) a fixed workload

    def __post_init__(self) -> None:
        if not (self.peak_rate > 0 and math.isfinite(self.peak_rate)):
            raise ValueError("the peak request rate must be a positive number")
        if not 0 < self.diurnal_trough <= 1:
            raise ValueError("diurnal trough must be in (0, 1]")
        if self.burst_factor <= 0:
            raise ValueError("burst factor must be positive")
        if self.mean_turns < 1:
            raise ValueError("mean turns per conversation must be at least 1")
        if not 0 <= self.reasoning_share <= 1:
            raise ValueError("reasoning share must be in [0, 1]")
        total = sum(t.share for t in self.tiers)
        if not self.tiers or total <= 0:
            raise ValueError("tiers must have positive shares")

    # -- rates --------------------------------------------------------------------
    def rate(self, t: float) -> float:
        """Messages per second at simulated time t."""
        day = (1 + math.cos(2 * math.pi * (t + self.start_offset_s) / DAY_S)) / 2
        r = self.peak_rate * (self.diurnal_trough + (1 - self.diurnal_trough) * day)
        if self.burst_duration_s > 0 and self.burst_start_s <= t < self.burst_start_s + self.burst_duration_s:
            r *= self.burst_factor
        return r

    @property
    def max_rate(self) -> float:
        return self.peak_rate * max(1.0, self.burst_factor)

    def conversation_rate(self, t: float) -> float:
        # Each conversation sends mean_turns messages, so this many start per second.
        return self.rate(t) / self.mean_turns

    @property
    def mean_answer_tokens(self) -> float:
        chat = self.answer_median_tokens * math.exp(self.answer_sigma ** 2 / 2)
        reason = self.reasoning_median_tokens * math.exp(self.reasoning_sigma ** 2 / 2)
        return (1 - self.reasoning_share) * min(chat, self.max_answer_tokens) + \
            self.reasoning_share * min(reason, self.max_answer_tokens)

    @classmethod
    def for_tokens_per_s(cls, peak_tokens_per_s: float, **kw) -> "TrafficModel":
        """The traffic whose peak output is `peak_tokens_per_s` generated tokens per second."""
        probe = cls(peak_rate=1.0, **kw)
        return cls(peak_rate=peak_tokens_per_s / probe.mean_answer_tokens, **kw)

    def scaled(self, factor: float) -> "TrafficModel":
        """The same traffic at `factor` times the rate (one cell's share of the fleet's)."""
        from dataclasses import replace

        return replace(self, peak_rate=self.peak_rate * factor)


class SimConversation:
    """One user's conversation: its turns so far and its block keys, kept incrementally."""

    __slots__ = ("cid", "tier", "turns_left", "turns", "tokens", "keys", "rng_seed")

    def __init__(self, cid: str, tier: SimTier, turns_left: int) -> None:
        self.cid = cid
        self.tier = tier
        self.turns_left = turns_left
        self.turns: list[tuple[list[int], list[int]]] = []  # (user tokens, answer tokens)
        self.tokens: list[int] = []   # the last prompt's token ids
        self.keys: list[int] = []     # block keys of the last prompt's full blocks


@dataclass
class SimTurn:
    conversation: SimConversation
    prompt: list[int]
    answer: list[int]
    reasoning: bool


class TrafficSource:
    """Draws conversations and turns from a TrafficModel with its own seeded generator."""

    def __init__(self, model: TrafficModel, seed: int, system_prompt: list[int] | None = None,
                 max_model_len: int = 8192) -> None:
        self.model = model
        self.rng = np.random.default_rng(seed)
        self.max_model_len = max_model_len
        m = model
        self.system_prompt = system_prompt if system_prompt is not None else \
            self.rng.integers(TOKEN_LO, TOKEN_HI, m.system_prompt_tokens).tolist()
        shares = np.array([t.share for t in m.tiers], dtype=float)
        self._tier_p = shares / shares.sum()
        self._count = 0
        self._t = 0.0

    # -- arrivals of new conversations (thinning a Poisson process at the top rate) -----
    def next_conversation_time(self, after: float, until: float) -> float | None:
        m, t = self.model, after
        top = m.max_rate / m.mean_turns
        while True:
            t += self.rng.exponential(1.0 / top)
            if t >= until:
                return None
            if self.rng.random() * top <= m.conversation_rate(t):
                return t

    def new_conversation(self) -> SimConversation:
        m = self.model
        self._count += 1
        tier = m.tiers[int(self.rng.choice(len(m.tiers), p=self._tier_p))]
        turns = int(self.rng.geometric(1.0 / m.mean_turns))
        return SimConversation(f"c{self._count}", tier, turns)

    def think_time(self) -> float:
        return float(self.rng.exponential(self.model.think_time_s))

    def _lognormal(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return int(min(max(round(median * math.exp(sigma * self.rng.standard_normal())), lo), hi))

    def next_turn(self, conv: SimConversation) -> SimTurn:
        """The conversation's next message: its prompt (system + the newest turns that fit) and the
        answer the model will give (drawn now; the simulator reveals it token by token)."""
        m = self.model
        conv.turns_left -= 1
        if m.single_prompt is not None:
            user = list(m.single_prompt)
        else:
            user = self.rng.integers(TOKEN_LO, TOKEN_HI,
                                     self._lognormal(m.user_median_tokens, m.user_sigma, 1, m.max_user_tokens)).tolist()
        reasoning = bool(self.rng.random() < m.reasoning_share)
        if reasoning:
            n_out = self._lognormal(m.reasoning_median_tokens, m.reasoning_sigma, 1, m.max_answer_tokens)
        else:
            n_out = self._lognormal(m.answer_median_tokens, m.answer_sigma, 1, m.max_answer_tokens)
        # The answer must fit the context window beside at least the system prompt and this message.
        room = self.max_model_len - len(self.system_prompt) - 1
        user = user[:max(1, room // 2)]
        n_out = max(1, min(n_out, room - len(user)))
        answer = self.rng.integers(TOKEN_LO, TOKEN_HI, n_out).tolist()
        # Newest turns that fit, as the product's prompt assembly does.
        budget = self.max_model_len - n_out - len(self.system_prompt) - len(user)
        kept, used = 0, 0
        for u, a in reversed(conv.turns):
            if used + len(u) + len(a) > budget:
                break
            used += len(u) + len(a)
            kept += 1
        if kept < len(conv.turns):  # older turns dropped: the prefix after the system prompt changes
            del conv.turns[:len(conv.turns) - kept]
            conv.keys = []
            conv.tokens = []
        prompt = list(self.system_prompt)
        for u, a in conv.turns:
            prompt += u
            prompt += a
        prompt += user
        conv.turns.append((user, answer))
        return SimTurn(conv, prompt, answer, reasoning)
