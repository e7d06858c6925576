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
# One int object per token id, shared by every token list: a list holds 8 bytes a token, not 40.
_TOKEN_OBJECTS = np.array(range(TOKEN_HI), dtype=object)


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


@dataclass
class InProgress:
    conversation: SimConversation
    delay: float | None  # thinking: until its next message; None: it sends no more (or is answering)
    idle: float          # thinking: since its last answer ended
    # Answering: (prompt with the answer's tokens so far, the tokens still to come, reasoning, seconds
    # since the message arrived).
    answering: tuple[list[int], list[int], bool, float] | None = None


class TrafficSource:
    """Draws conversations and turns from a TrafficModel with its own seeded generator."""

    def __init__(self, model: TrafficModel, seed: int, system_prompt: list[int] | None = None,
                 max_model_len: int = 8192) -> None:
        self.model = model
        self.rng = np.random.default_rng(seed)
        self.max_model_len = max_model_len
        m = model
        self.system_prompt = system_prompt if system_prompt is not None else \
            self._tokens(m.system_prompt_tokens)
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

    def in_progress(self, t: float, token_s: float) -> list[InProgress]:
        """The conversations under way at time `t` in the steady state, with their past turns drawn:
        what a run started from an empty fleet reaches only after several conversation lifetimes.
        `token_s` is the time an answer takes per token (a loaded replica's decode step), which sets
        how long a turn lasts.

        Turns are geometric, so both the messages a conversation under way has sent (the current one
        included: at least one) and those it will still send (possibly none) are geometric too
        (memoryless). The current turn (answer, then think time) is caught at a uniform point of its
        length, and longer turns are caught more often (length-biased): either within its answer
        (`answering`: the tokens made so far join the prompt, the rest is still to come) or thinking,
        `delay` seconds before its next message (None: it sends no more) and `idle` seconds after its
        last answer ended (for the caches' eviction order)."""
        m = self.model
        p = 1.0 / m.mean_turns
        turn_s = m.think_time_s + token_s * m.mean_answer_tokens
        longest = token_s * m.max_answer_tokens + 8 * m.think_time_s
        out = []
        for _ in range(int(self.rng.poisson(m.conversation_rate(t) * m.mean_turns * turn_s))):
            conv = self.new_conversation()
            past, ahead = int(self.rng.geometric(p)), int(self.rng.geometric(p)) - 1
            conv.turns_left = past + ahead
            for _ in range(past - 1):
                self.next_turn(conv)
            while True:  # the current turn, length-biased by rejection
                reasoning = bool(self.rng.random() < m.reasoning_share)
                tokens, think = self._answer_tokens(reasoning), self.think_time()
                if self.rng.random() * longest <= tokens * token_s + think:
                    break
            turn = self.next_turn(conv, (reasoning, tokens))
            answer_s = len(turn.answer) * token_s
            at = self.rng.random() * (answer_s + think)
            if at < answer_s and len(turn.answer) >= 3:
                done = min(len(turn.answer) - 2, max(1, int(at / token_s)))
                out.append(InProgress(conv, None, 0.0, (turn.prompt + turn.answer[:done], turn.answer[done:],
                                                        turn.reasoning, at)))
            else:
                out.append(InProgress(conv, answer_s + think - at if ahead else None, at - answer_s))
        return out

    def history(self, conv: SimConversation) -> list[int]:
        """The tokens a replica holds for `conv` after its last answer: its next prompt's prefix."""
        tokens = list(self.system_prompt)
        for u, a in conv.turns:
            tokens += u
            tokens += a
        return tokens

    def _answer_tokens(self, reasoning: bool) -> int:
        m = self.model
        if reasoning:
            return self._lognormal(m.reasoning_median_tokens, m.reasoning_sigma, 1, m.max_answer_tokens)
        return self._lognormal(m.answer_median_tokens, m.answer_sigma, 1, m.max_answer_tokens)

    def _tokens(self, n: int) -> list[int]:
        return _TOKEN_OBJECTS[self.rng.integers(TOKEN_LO, TOKEN_HI, n)].tolist()

    def think_time(self) -> float:
        return float(self.rng.exponential(self.model.think_time_s))

    def _lognormal(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return int(min(max(round(median * math.exp(sigma * self.rng.standard_normal())), lo), hi))

    def next_turn(self, conv: SimConversation, answer: tuple[bool, int] | None = None) -> SimTurn:
        """The conversation's next message: its prompt (system + the newest turns that fit) and the
        answer the model will give (drawn now; the simulator reveals it token by token), or the
        answer's kind and length given as (reasoning, tokens)."""
        m = self.model
        conv.turns_left -= 1
        if m.single_prompt is not None:
            user = list(m.single_prompt)
        else:
            user = self._tokens(self._lognormal(m.user_median_tokens, m.user_sigma, 1, m.max_user_tokens))
        if answer is None:
            reasoning = bool(self.rng.random() < m.reasoning_share)
            n_out = self._answer_tokens(reasoning)
        else:
            reasoning, n_out = answer
        # The answer must fit the context window beside at least the system prompt and this message.
        room = self.max_model_len - len(self.system_prompt) - 1
        user = user[:max(1, room // 2)]
        n_out = max(1, min(n_out, room - len(user)))
        answer = self._tokens(n_out)
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
