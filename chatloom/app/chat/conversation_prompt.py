"""The prompt for a conversation's next answer: system prompt, summary of older turns, newest turns.

The pure planning lives in prompt.py; this is its I/O: reading the branch from the store, asking the
model for summaries of turns that no longer fit (and saving them), and counting what a new message
needs before anything is saved, so a message that can never fit is refused at once.
"""
from __future__ import annotations

import logging
from typing import Callable

from chatloom.app.chat.branches import Tree
from chatloom.app.core.errors import ApiError
from chatloom.app.chat.prompt import (SUMMARY_HEADER, TemplateCost, Turn, build_messages, chunk_turns, plan_prompt,
                                 summarizer_messages)
from chatloom.app.core.settings import Settings
from chatloom.serving import Backend, BadGenerationRequest, GenerationRequest, Usage
from chatloom.store import Conversations, Database, Messages

log = logging.getLogger(__name__)


class ConversationDeleted(Exception):
    """The conversation went away while its answer was starting."""


class SummaryAborted(Exception):
    """A summary request ended with 'abort' (the answer was stopped while summarizing)."""


class PromptAssembler:
    def __init__(self, db: Database, backend: Backend, settings: Settings, context_window: Callable[[], int]) -> None:
        self.db = db
        self.backend = backend
        self.settings = settings
        self._window = context_window
        self._cost: TemplateCost | None = None

    @property
    def context_window(self) -> int:
        return self._window()

    @property
    def template_cost(self) -> TemplateCost:
        if self._cost is None:
            self._cost = TemplateCost.measure(self.backend.count_prompt_tokens, self.backend.count_tokens)
        return self._cost

    def summary_max_tokens(self) -> int:
        return max(16, min(self.settings.summary_max_tokens, self.context_window // 4))

    # -- before anything is saved ----------------------------------------------------------
    def check_fits(self, text_tokens: int, max_tokens: int) -> None:
        """The new message, the system prompt and the answer must fit the context window on their own."""
        needed = self.template_cost.prompt(self.backend.count_tokens(self.settings.system_prompt), [text_tokens])
        room = self.context_window - max_tokens
        if needed > room:
            raise ApiError(400, f"the message is too long: it takes {text_tokens} tokens, and with max_tokens="
                           f"{max_tokens} only {max(0, room - (needed - text_tokens))} fit in the "
                           f"{self.context_window}-token context window", "context_length_exceeded", "text")

    def estimate(self, turn_tokens: list[int], max_tokens: int) -> int:
        """The prompt's tokens from stored counts, as assembly will see them (older turns fold into a summary)."""
        system = self.backend.count_tokens(self.settings.system_prompt)
        return min(self.template_cost.prompt(system, turn_tokens), self.context_window - max_tokens)

    # -- in the background job ---------------------------------------------------------------
    async def assemble(self, conversation_id: str, question_id: str, model: str, max_tokens: int,
                       summary_request: Callable[[], str], charge: Callable[[Usage], None],
                       admit_summary: Callable | None = None) -> list[dict]:
        """The messages for the answer to `question_id`, within the window minus max_tokens.
        Summaries are requested under ids from `summary_request()` and their tokens passed to `charge`."""
        async with self.db.session() as session:
            conv = await Conversations(session).get(conversation_id)
            if conv is None:
                raise ConversationDeleted
            tree = Tree(await Messages(session).all_in(conv.id))
            summary, summary_upto = conv.summary, conv.summary_upto
        path = tree.path_to(question_id)
        path_ids = [m.id for m in path]
        # A summary belongs to one branch: use it only if it covers a prefix of this one.
        if summary and summary_upto in path_ids:
            rest = path[path_ids.index(summary_upto) + 1:]
        else:
            summary, rest = None, path
        history = [Turn(m.id, m.role, m.text, m.tokens) for m in rest if m.text]
        count = self.backend.count_tokens
        system = self.settings.system_prompt
        budget = self.context_window - max_tokens
        reserve = self.summary_max_tokens() + count(SUMMARY_HEADER)
        plan = plan_prompt(history, budget=budget, cost=self.template_cost, system_tokens=count(system),
                           summary_tokens=count(SUMMARY_HEADER + summary) if summary else 0,
                           summary_reserve=reserve, keep_fraction=self.settings.summary_keep_fraction)
        if not plan.use_summary:
            summary = None
        elif plan.to_summarize:
            new_summary = await self._summarize(summary, plan.to_summarize, model, summary_request, charge,
                                                admit_summary)
            if new_summary:
                summary = new_summary
                async with self.db.session() as session:
                    await Conversations(session).touch(conversation_id, summary=summary,
                                                       summary_upto=plan.to_summarize[-1].id)
                    await session.commit()
            else:
                summary = None
        kept = list(plan.kept)
        messages = build_messages(system, summary, kept)
        # Stored counts are estimates of the rendered prompt; drop the oldest turns if the exact count disagrees.
        while len(kept) > 1 and self.backend.count_prompt_tokens(messages) > budget:
            kept.pop(0)
            messages = build_messages(system, summary, kept)
        return messages

    async def _summarize(self, previous: str | None, turns: list[Turn], model: str,
                         summary_request: Callable[[], str], charge: Callable[[Usage], None],
                         admit_summary: Callable | None = None) -> str | None:
        """Fold `turns` into the running summary, one context-sized chunk at a time."""
        max_tokens = self.summary_max_tokens()
        count = self.backend.count_tokens
        framing = summarizer_messages(None, [])
        overhead = self.template_cost.prompt(0, [0, 0]) + count(framing[0]["content"]) \
            + count(framing[1]["content"]) + 8
        label_tokens = count("Assistant: ") + 1  # each transcript line's label and newline
        summary = previous
        while turns:
            budget = self.context_window - max_tokens - overhead - (count(summary) if summary else 0)
            chunk = chunk_turns(turns, budget, per_turn=label_tokens)[0]
            turns = turns[len(chunk):]
            request = GenerationRequest(messages=summarizer_messages(summary, chunk), model=model,
                                        max_tokens=max_tokens, temperature=0.0, request_id=summary_request())
            try:
                if admit_summary is None:
                    result = await self.backend.complete(request)
                else:  # i12: reserved against the quota and admitted through the queue, like an answer
                    async with admit_summary(request) as admitted:
                        if not admitted:  # no quota or no room: no summary; the oldest turns are dropped
                            return None
                        result = await self.backend.complete(request)
            except BadGenerationRequest as exc:
                log.warning("summary skipped: %s", exc)
                return summary
            charge(result.usage)  # model work for this user: counted and metered
            if result.finish_reason == "abort":
                raise SummaryAborted
            summary = result.text.strip() or summary
        return summary
