"""The values of a generation's trip: what a front asks for (`Ask`), what the caps leave it (`Limits`), the
prompts a run takes, the pieces its stream yields, and the two ways a run ends early. Frozen dataclasses
and unions, so fronts match on types (pipeline.py explains the trip itself)."""
from __future__ import annotations

from dataclasses import dataclass

from chatloom.app.generation.tool_calls import ToolCall, ToolUse
from chatloom.app.traffic.tiers import Tier
from chatloom.serving import Constraint, Timings, Usage
from chatloom.serving.backend import TextLogprob
from chatloom.store import User


# -- what a front asks for -------------------------------------------------------------------

@dataclass(frozen=True)
class Ask:
    """A generation as a front received it, before any check. None means the service's default."""

    user: User
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # sample from the k likeliest tokens only (None or 0: all of them)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    reasoning_effort: str | None = None  # low | medium | high: think first (chat prompts only)
    request_id: str | None = None  # default: a fresh id
    param: str = "messages"  # the request field that errors about the prompt name
    constraint: Constraint | None = None  # the answer must match this grammar
    tools: ToolUse | None = None  # tools the model may call: its calls come out as ToolCall pieces
    # Work that can wait (the Batch API): admitted below every interactive tier, last in the engine's
    # order, and charged to the quota at the batch discount.
    batch: bool = False
    n: int = 1  # answers to the prompt, one prefill for all (Run.stream_choices yields them by index)
    # Log probabilities of the answer's tokens with this many alternatives each (AnswerText.logprobs), and
    # of the prompt's tokens (a PromptLogprobs piece); None: not asked.
    logprobs: int | None = None
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class Limits:
    """The ask after the caps: what the run may spend."""

    model: str
    tier: Tier
    max_tokens: int  # the answer's budget, thinking included
    temperature: float
    top_p: float
    effort: str | None


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict]  # [{"role", "content"}]
    # the last message is an unfinished assistant turn to go on from (an interrupted answer resuming)
    continue_final: bool = False


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: list[int]


Prompt = ChatPrompt | TextPrompt | TokenPrompt


# -- what a run yields ----------------------------------------------------------------------

@dataclass(frozen=True)
class Thinking:
    """Reasoning text (from the <think> block), shown apart from the answer."""

    text: str


@dataclass(frozen=True)
class AnswerText:
    """Answer text that passed the output guard; where the ask wants them, the log probabilities of the
    tokens whose text is now out (choice_stream.py)."""

    text: str
    logprobs: tuple[TextLogprob, ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt tokens' log probabilities (None for the first token), before a choice's first answer piece."""

    entries: tuple[TextLogprob | None, ...]


@dataclass(frozen=True)
class Finished:
    """The last piece: why the answer ended (stop | length | abort | content_filter | tool_calls) and what
    it cost; with 'stop', the stop sequence that ended it where the backend says (None: an end token)."""

    finish_reason: str
    usage: Usage
    timings: Timings | None = None
    stop_sequence: str | None = None


Piece = Thinking | AnswerText | ToolCall | PromptLogprobs | Finished


@dataclass(frozen=True)
class Choice:
    """A piece of choice `index` of an ask with n > 1; each choice ends with its own Finished."""

    index: int
    piece: Piece


class GenerationStopped(Exception):
    """Run.stop() was called while the run waited for admission: nothing ran, nothing is owed."""


class BudgetSpent(Exception):
    """The next round's prompt leaves no room in the tokens reserved for the run: the answer ends as
    'length' (the quota is not asked for more once the answer has begun)."""
