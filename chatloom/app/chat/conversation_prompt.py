"""The prompt for a conversation's next answer: system prompt, summary of older turns, newest turns.

The pure planning lives in prompt.py; this is its I/O: reading the branch from the store, asking the
model for summaries of turns that no longer fit (and saving them), and counting what a new message
needs before anything is saved, so a message that can never fit is refused at once.

An answer's prompt is planned in two steps so that its quota is reserved before any response: `plan`
(no model work, before the answer starts) chooses the stored summary and the newest turns that fit,
and says whether older turns must first be folded into a new summary; the job then writes that
summary, if any (`write_summary`), and `build` makes the messages within the tokens reserved.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.chat.branches import Tree
from chatloom.app.core.memory import system_prompt_for
from chatloom.app.core.errors import ApiError
from chatloom.app.chat.message_images import with_images
from chatloom.store.blobs import BlobStore
from chatloom.app.chat.prompt import (SUMMARY_HEADER, TemplateCost, Turn, build_messages, chunk_turns, plan_prompt,
                                 summarizer_messages)
from chatloom.app.chat.recall import RECALL_HEADER, recalled_text
from chatloom.settings import Settings
from chatloom.serving import Backend, BadGenerationRequest, GenerationRequest, Usage
from chatloom.store import Conversations, Database, Message, Messages

log = logging.getLogger(__name__)

# Tokens a summary may add beyond its own at the joins with the text around it (a tokenizer can merge
# across them); part of the upper bound reserved for a prompt whose summary is written later.
SUMMARY_JOIN_SLACK = 4


class ConversationDeleted(Exception):
    """The conversation went away while its answer was starting."""


class SummaryAborted(Exception):
    """A summary request ended with 'abort' (the answer was stopped while summarizing)."""


@dataclass
class Draft:
    """An answer's prompt as planned before the answer starts, with no model work: the stored summary
    to use and the newest turns that fit. When older turns no longer fit and no summary covers them,
    `to_summarize` lists them: the job writes a new summary of them first, within `summary_tokens`
    of quota (an estimate from the turns' stored counts)."""

    summary: str | None
    kept: list[Turn]
    to_summarize: list[Turn] = field(default_factory=list)
    summary_tokens: int = 0
    context: str = ""  # what the system message gains before the summary: passages of the user's files
    system: str = ""  # the system prompt (the server's, with the user's instructions and memories)

    @property
    def pending(self) -> bool:
        """A new summary must be written before the prompt is known exactly."""
        return bool(self.to_summarize)


def branch_turns(path: Sequence[Message], summary: str | None,
                 summary_upto: str | None) -> tuple[list[Turn], str | None]:
    """The turns of a branch (root first) the stored summary does not cover, and that summary (None when
    it belongs to another branch)."""
    path_ids = [m.id for m in path]
    # A summary belongs to one branch: use it only if it covers a prefix of this one.
    if summary and summary_upto in path_ids:
        rest = list(path[path_ids.index(summary_upto) + 1:])
    else:
        summary, rest = None, list(path)
    return [Turn(m.id, m.role, m.text, m.tokens) for m in rest if m.text], summary


class PromptAssembler:
    def __init__(self, db: Database, backend: Backend, settings: Settings, context_window: Callable[[], int],
                 blobs: BlobStore | None = None) -> None:
        self.db = db
        self.blobs = blobs  # where the images of user messages are (None: a conversation holds text only)
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
        return max(16, min(self.settings.chat.summary_max_tokens, self.context_window // 4))

    # -- before anything is saved ----------------------------------------------------------
    def check_fits(self, text_tokens: int, max_tokens: int) -> None:
        """The new message, the system prompt and the answer must fit the context window on their own."""
        needed = self.template_cost.prompt(self.backend.count_tokens(self.settings.chat.system_prompt), [text_tokens])
        room = self.context_window - max_tokens
        if needed > room:
            raise ApiError(400, f"the message is too long: it takes {text_tokens} tokens, and with max_tokens="
                           f"{max_tokens} only {max(0, room - (needed - text_tokens))} fit in the "
                           f"{self.context_window}-token context window", "context_length_exceeded", "text")

    # -- planning: before the answer starts -------------------------------------------------
    async def system_for(self, user_id: str, session: AsyncSession | None = None) -> str:
        """The system prompt of the user's answers: the server's, their instructions and memories. Read in
        `session` where the caller holds one: a second connection per request would drain the pool."""
        if session is not None:
            return await system_prompt_for(session, self.settings, user_id, self.backend.count_tokens)
        async with self.db.session() as own:
            return await system_prompt_for(own, self.settings, user_id, self.backend.count_tokens)

    async def load(self, conversation_id: str, question_id: str) -> tuple[list[Turn], str | None]:
        """The branch ending at `question_id` from the store: its turns after the summary, and the summary."""
        async with self.db.session() as session:
            conv = await Conversations(session).get(conversation_id)
            if conv is None:
                raise ConversationDeleted
            tree = Tree(await Messages(session).all_in(conv.id))
            turns, summary = branch_turns(tree.path_to(question_id), conv.summary, conv.summary_upto)
            return await self.with_images(session, turns), summary

    async def with_images(self, session, turns: list[Turn]) -> list[Turn]:
        """The turns with their messages' images (read from the blob store)."""
        if self.blobs is None:
            return turns
        return await with_images(session, self.blobs, turns, self.settings.vision.max_image_pixels)

    def retrieved_turns_tokens(self) -> int:
        return min(self.settings.chat.retrieved_turns_tokens, self.context_window // 4)

    def plan(self, history: list[Turn], summary: str | None, max_tokens: int, extra_tokens: int = 0,
             context: str = "", system: str | None = None, recall: list[tuple[int, Turn]] | None = None) -> Draft:
        """Which turns go in, from their stored counts. `extra_tokens`: what the prompt as sent adds to the
        system prompt and the turns (tool descriptions, thinking instructions, an answer being continued).
        `context`: retrieved passages for the system message (their tokens come out of the history's room).
        `system`: the system prompt (system_for); default the server's. `recall`: earlier turns of the
        branch relevant to the new message, best first, each with its place in the branch (recall.py);
        those that do not stay in the prompt verbatim join the system message, within
        `chat.retrieved_turns_tokens`."""
        count = self.backend.count_tokens
        system = system if system is not None else self.settings.chat.system_prompt
        mode = self.settings.chat.older_turns
        summarize = mode != "retrieved"
        recall = list(recall or []) if mode != "summary" else []
        summary = summary if summarize else None

        def planned(reserve: int):
            return plan_prompt(history, budget=self.context_window - max_tokens, cost=self.template_cost,
                               system_tokens=count((system or self.settings.chat.system_prompt) + context)
                               + extra_tokens + reserve,
                               summary_tokens=count(SUMMARY_HEADER + summary) if summary else 0,
                               summary_reserve=self.summary_max_tokens() + count(SUMMARY_HEADER) if summarize else 0,
                               keep_fraction=self.settings.chat.summary_keep_fraction)

        plan = planned(0)
        if any(t.id not in {k.id for k in plan.kept} for _, t in recall):
            # Room for the retrieved turns comes out of the verbatim turns'.
            plan = planned(self.retrieved_turns_tokens())
        kept_ids = {k.id for k in plan.kept}
        recalled = self._fit_recalled([(at, t) for at, t in recall if t.id not in kept_ids],
                                      self.retrieved_turns_tokens())
        draft = Draft(summary if plan.use_summary else None, list(plan.kept),
                      list(plan.to_summarize) if summarize else [], context=context + recalled, system=system)
        if draft.pending:
            draft.summary_tokens = self.summary_cost(draft.summary, draft.to_summarize)
        return draft

    def _fit_recalled(self, ranked: list[tuple[int, Turn]], budget: int) -> str:
        """The best of `ranked` that fit `budget` tokens together, in the branch's order, as the system
        message's part; a turn taking more than half the room alone is cut to that (its head: where a
        question or an answer begins)."""
        count = self.backend.count_tokens
        chosen: list[tuple[int, Turn]] = []
        used = count(RECALL_HEADER)
        half = (budget - used) // 2
        for at, t in ranked:
            if t.tokens + 4 > half:
                keep = max(1, int(len(t.text) * half / max(t.tokens, 1) * 0.8))
                t = Turn(t.id, t.role, t.text[:keep] + "…", count(t.text[:keep]) + 1)
            if used + t.tokens + 4 > budget:  # 4: the transcript's "User: " and the line break
                continue
            chosen.append((at, t))
            used += t.tokens + 4

        def text_of(items: list[tuple[int, Turn]]) -> str:
            return recalled_text([t for _, t in sorted(items, key=lambda item: item[0])])

        text = text_of(chosen)
        while chosen and count(text) > budget:  # the stored counts were short: drop the least relevant
            chosen.pop()
            text = text_of(chosen)
        return text

    def build(self, draft: Draft, summary: str | None, count: Callable[[list[dict]], int], limit: int) -> list[dict]:
        """The messages: system prompt (with `summary`) and the draft's turns, the oldest dropped while the
        prompt as sent (`count`) takes more than `limit` tokens; the newest turn is always kept."""
        system = (draft.system or self.settings.chat.system_prompt) + draft.context
        kept = list(draft.kept)
        messages = build_messages(system, summary, kept)
        # Stored counts are estimates of the rendered prompt; drop the oldest turns if the exact count disagrees.
        while len(kept) > 1 and count(messages) > limit:
            kept.pop(0)
            messages = build_messages(system, summary, kept)
        return messages

    def bound(self, draft: Draft, count: Callable[[list[dict]], int], limit: int) -> int:
        """An upper bound of the tokens of the prompt `build` will make once a pending summary is written:
        the draft's turns counted exactly, plus the largest summary; at most `limit` unless even the
        turns without a summary take more (build then drops turns to fit)."""
        without = count(build_messages((draft.system or self.settings.chat.system_prompt) + draft.context, None,
                                       draft.kept))
        if not draft.pending:
            return without
        most = without + self.backend.count_tokens(SUMMARY_HEADER) + self.summary_max_tokens() + SUMMARY_JOIN_SLACK
        return max(min(most, limit), without)

    def summary_cost(self, previous: str | None, turns: list[Turn]) -> int:
        """The quota the summary of `turns` is expected to take (every request's prompt plus max_tokens),
        chunked as `_summarize` chunks them, each later chunk's running summary at its largest."""
        max_tokens, overhead, label_tokens = self._summary_framing()
        running = self.backend.count_tokens(previous) if previous else 0
        total = 0
        while turns:
            chunk = chunk_turns(turns, self.context_window - max_tokens - overhead - running, per_turn=label_tokens)[0]
            turns = turns[len(chunk):]
            total += overhead + running + sum(t.tokens + label_tokens for t in chunk) + max_tokens
            running = max_tokens
        return total

    # -- in the background job ---------------------------------------------------------------
    async def write_summary(self, draft: Draft, conversation_id: str, model: str, summary_request: Callable[[], str],
                            charge: Callable[[Usage], None], admit_summary: Callable | None = None) -> str | None:
        """The summary the prompt uses: the draft's, or a new one of its older turns (saved), or None when
        that could not be written (the oldest turns are then left out)."""
        if not draft.pending:
            return draft.summary
        summary = await self._summarize(draft.summary, draft.to_summarize, model, summary_request, charge,
                                        admit_summary)
        if not summary:
            return None
        async with self.db.session() as session:
            await Conversations(session).touch(conversation_id, summary=summary, summary_upto=draft.to_summarize[-1].id)
            await session.commit()
        return summary

    def _summary_framing(self) -> tuple[int, int, int]:
        """A summary request's max_tokens, the tokens of its framing, and each transcript line's label."""
        count = self.backend.count_tokens
        framing = summarizer_messages(None, [])
        overhead = self.template_cost.prompt(0, [0, 0]) + count(framing[0]["content"]) \
            + count(framing[1]["content"]) + 8
        return self.summary_max_tokens(), overhead, count("Assistant: ") + 1

    async def _summarize(self, previous: str | None, turns: list[Turn], model: str,
                         summary_request: Callable[[], str], charge: Callable[[Usage], None],
                         admit_summary: Callable | None = None) -> str | None:
        """Fold `turns` into the running summary, one context-sized chunk at a time."""
        max_tokens, overhead, label_tokens = self._summary_framing()
        count = self.backend.count_tokens
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
                else:  # reserved against the quota and admitted through the queue, like an answer
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
