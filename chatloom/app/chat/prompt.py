"""Prompt assembly: system prompt + stored summary of older turns + the newest turns that fit.

Pure functions over token counts; the conversation service does the I/O. Costs are estimated
from each message's stored token count plus the chat template's per-message overhead, so a long
history is never re-tokenized to build one prompt.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from chatloom.serving.images import IMAGE_MARKER

SUMMARY_HEADER = "\n\nSummary of the earlier part of this conversation:\n"

SUMMARIZER_SYSTEM = "You write short, faithful summaries of conversations."
SUMMARIZER_INSTRUCTIONS = (
    "Summarize the conversation below in a few sentences. Keep the names, numbers, facts, "
    "preferences and decisions that later replies may need. Write only the summary."
)


@dataclass(frozen=True)
class Turn:
    id: str
    role: str  # user | assistant
    text: str
    tokens: int  # of the text and its images
    images: tuple = ()  # serving.images.ImageData of a user turn, shown before its text


@dataclass(frozen=True)
class TemplateCost:
    """How many tokens the chat template adds: `fixed` once per prompt, `per_message` per message."""

    fixed: int
    per_message: int

    @classmethod
    def measure(cls, count_prompt: Callable[[list[dict]], int], count_text: Callable[[str], int]) -> "TemplateCost":
        """Derive the overheads by rendering two small conversations."""
        s, a, b, c = "You are terse.", "Hello there.", "Hi! How can I help?", "Tell me a joke."
        short = [{"role": "system", "content": s}, {"role": "user", "content": a}]
        long = short + [{"role": "assistant", "content": b}, {"role": "user", "content": c}]
        n_short, n_long = count_prompt(short), count_prompt(long)
        per = max(0, math.ceil((n_long - n_short - count_text(b) - count_text(c)) / 2))
        fixed = max(0, n_short - count_text(s) - count_text(a) - 2 * per)
        return cls(fixed, per)

    def prompt(self, system_tokens: int, turn_tokens: list[int]) -> int:
        return self.fixed + system_tokens + self.per_message + sum(t + self.per_message for t in turn_tokens)


@dataclass
class PromptPlan:
    kept: list[Turn]  # the newest turns, sent verbatim
    to_summarize: list[Turn] = field(default_factory=list)  # older turns the summary must absorb first
    use_summary: bool = True  # False: the kept turns leave no room for a summary at all


def plan_prompt(history: list[Turn], *, budget: int, cost: TemplateCost, system_tokens: int,
                summary_tokens: int, summary_reserve: int, keep_fraction: float = 0.5) -> PromptPlan:
    """Choose which turns go into the prompt.

    history: the branch's turns not yet covered by the summary, oldest first, ending with the new
    user message. budget: the context window minus the answer's max tokens. summary_tokens: what
    the current summary costs (0 without one). summary_reserve: room to keep for a new summary.
    """
    def turn_cost(turns: list[Turn]) -> int:
        return sum(t.tokens + cost.per_message for t in turns)

    fixed = cost.fixed + system_tokens + cost.per_message
    if fixed + summary_tokens + turn_cost(history) <= budget:
        return PromptPlan(kept=list(history))
    room = budget - fixed - summary_reserve
    last = history[-1:]
    if turn_cost(last) > room:
        # Even the new message alone leaves no room for a summary: send it without history.
        return PromptPlan(kept=last, use_summary=False)
    # Keep less than fits, so the next few turns fit without summarizing again.
    target = max(int(room * keep_fraction), turn_cost(last))
    kept: list[Turn] = []
    used = 0
    for turn in reversed(history):
        c = turn.tokens + cost.per_message
        if kept and used + c > target:
            break
        kept.insert(0, turn)
        used += c
    # Start the verbatim part at a user turn; some chat templates insist on user/assistant alternation.
    while len(kept) > 1 and kept[0].role != "user":
        kept.pop(0)
    return PromptPlan(kept=kept, to_summarize=history[: len(history) - len(kept)])


def system_content(system_prompt: str, summary: str | None) -> str:
    return system_prompt + (SUMMARY_HEADER + summary if summary else "")


def build_messages(system_prompt: str, summary: str | None, turns: list[Turn]) -> list[dict]:
    return ([{"role": "system", "content": system_content(system_prompt, summary)}] + [_turn(t) for t in turns])


def _turn(t: Turn) -> dict:
    if not t.images:
        return {"role": t.role, "content": t.text}
    return {"role": t.role, "content": IMAGE_MARKER * len(t.images) + t.text, "images": list(t.images)}


def transcript(turns: list[Turn]) -> str:
    return "\n".join(f"{'User' if t.role == 'user' else 'Assistant'}: {t.text}" for t in turns)


def summarizer_messages(previous: str | None, turns: list[Turn]) -> list[dict]:
    parts = [SUMMARIZER_INSTRUCTIONS]
    if previous:
        parts.append(f"Summary so far:\n{previous}")
    parts.append(f"Conversation:\n{transcript(turns)}")
    return [{"role": "system", "content": SUMMARIZER_SYSTEM}, {"role": "user", "content": "\n\n".join(parts)}]


def chunk_turns(turns: list[Turn], budget: int, per_turn: int = 0) -> list[list[Turn]]:
    """Split turns into runs that fit `budget` tokens each (a turn costs its tokens + per_turn).
    A turn larger than the budget alone is clipped to its head: a summary needs the gist, not every word."""
    chunks: list[list[Turn]] = []
    current: list[Turn] = []
    used = 0
    budget = max(budget, per_turn + 8)
    for t in turns:
        if t.tokens + per_turn > budget:
            allowed = budget - per_turn
            keep = max(1, int(len(t.text) * allowed / max(t.tokens, 1) * 0.8))
            t = Turn(t.id, t.role, t.text[:keep], allowed)
        if current and used + t.tokens + per_turn > budget:
            chunks.append(current)
            current, used = [], 0
        current.append(t)
        used += t.tokens + per_turn
    if current:
        chunks.append(current)
    return chunks
