"""The job that writes one answer: assemble the prompt, stream through the pipeline, run chat tools
between rounds, log every piece, then save the answer and close its log.

With chat tools on (settings.chat.tools), an answer may call them: when a round of generation ends
in tool calls, the loop pauses, runs each call (app/tools), logs `tool_call` and `tool_result`
events, appends the calls and results to the prompt and resumes the same run, whose new prompt
starts with the previous one token for token, so the prefix cache makes resumption cheap. At most
settings.chat.max_tool_calls_per_answer calls run per answer; after that the model must answer in text.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

from chatloom.app.chat.final_save import LOST, SAVED, UNSAVED, Metered, save_answer
from chatloom.app.chat.conversation_prompt import ConversationDeleted, Draft, PromptAssembler, SummaryAborted
from chatloom.app.chat.summary_admission import admitted_summary
from chatloom.app.tools.registry import ToolContext, ToolRegistry
from chatloom.app.core.errors import ApiError, error_event
from chatloom.app.generation.pipeline import (AnswerText, BudgetSpent, ChatPrompt, Finished, GenerationStopped,
                                              Pipeline, Run, Thinking, ToolCall)
from chatloom.app.generation.tool_calls import render_messages
from chatloom.app.generation.tool_kv import keeps_kv, release_kv, tools_started
from chatloom.app.state.answer_journal import JournaledLog
from chatloom.app.state.events import EventLogStore
from chatloom.app.state.jobs import Jobs
from chatloom.app.state.redis_events import LogTakenOver
from chatloom.serving import Backend, BackendError, BadGenerationRequest, Usage
from chatloom.settings import Settings
from chatloom.store import Database
from chatloom.store.blobs import BlobStore

log = logging.getLogger(__name__)

STATUS_FOR_FINISH = {"stop": "complete", "tool_calls": "complete", "length": "incomplete", "abort": "stopped", "content_filter": "filtered"}


@dataclass
class Generation:
    """A running (or recently finished) answer."""

    conversation_id: str
    user_message_id: str  # the message being answered
    message_id: str  # the assistant message being written
    run: Run
    log: JournaledLog  # text reaches the database before readers (state/answer_journal.py)
    summary_ids: int = 0  # summary requests made so far (each has its own request id)
    stop_requested: bool = False
    task: asyncio.Task | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    # The answer so far, continued from here: saved text (recovery.py) or, taken over from a gateway
    # that died, the text its log already holds (prefix_logged: readers have it).
    prefix: str = ""
    prefix_logged: bool = False
    abandoned: bool = False  # another gateway has the job: end here without saving anything
    tokens_before: int = 0  # answer tokens the taken-over prefix already had (its log says how many)
    # The prompt as planned and reserved before the answer started (None: taken over, planned by the job):
    # `prompt` when it is known exactly, else the draft whose summary the job writes first and the
    # tokens reserved for the prompt it then builds.
    prompt: ChatPrompt | None = None
    draft: Draft | None = None
    prompt_tokens: int = 0
    citations: list[dict] | None = None  # the passages of the user's files the prompt holds, numbered

    def answer_tokens(self) -> int:
        """Answer tokens so far, every round's and those made before a takeover: logged beside each piece
        for a gateway that may take this over, and reported when the answer is done."""
        return self.tokens_before + self.run.answer_usage.completion_tokens

    def next_summary_id(self) -> str:
        self.summary_ids += 1
        return f"{self.message_id}-summary-{self.summary_ids - 1}"


@dataclass
class Outcome:
    answer: list[str] = field(default_factory=list)  # as shown: thinking and held-back text excluded
    thinking: list[str] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)  # tool calls and their results, in order
    finish_reason: str | None = None
    error: Exception | None = None


class AnswerJob:
    """Running one answer to its end (a mixin of ConversationService)."""

    # Set up by ConversationService.__init__.
    db: Database
    backend: Backend
    settings: Settings
    logs: EventLogStore
    prompts: PromptAssembler
    jobs: Jobs
    pipeline: Pipeline
    tools: ToolRegistry
    blobs: BlobStore | None
    _running: dict[str, Generation | None]

    async def _run(self, gen: Generation) -> None:
        out = Outcome(answer=[gen.prefix] if gen.prefix_logged else [])
        run = gen.run
        try:
            first = await self._first_prompt(gen)
            if gen.stop_requested:
                raise GenerationStopped
            if gen.prefix:  # the saved (or logged) text opens the assistant's turn; readers see it whole
                if not gen.prefix_logged:  # a continued answer: a fresh log, the text saved already
                    text = gen.prefix.replace("\x00", "")
                    out.answer.append(text)
                    await gen.log.append({"token": text}, answer_tokens=gen.answer_tokens(), saved=True)

            async def position(n: int) -> None:
                if not gen.log.closed:
                    await gen.log.append({"queue_position": n})

            # Tool rounds go on from the prompt without the open assistant turn (an answer continued from
            # saved text has no tools).
            messages = first.messages[:-1] if first.continue_final else first.messages
            await run.admit(first, position)
            for round_no in range(self.settings.chat.max_tool_calls_per_answer + 1):
                text, calls = ([gen.prefix] if gen.prefix and round_no == 0 else []), []
                run.keeps_kv = keeps_kv(run)  # a round that may call tools keeps its KV cache for tools_started
                async for piece in run.stream():
                    await self._write(gen, piece, out)
                    if isinstance(piece, AnswerText):
                        text.append(piece.text)
                    elif isinstance(piece, ToolCall):
                        calls.append(piece)
                    elif isinstance(piece, Finished) and round_no > 0:  # what resuming after the tools cost
                        self.pipeline.traffic.metrics.observe_resume(piece.usage, piece.timings)
                if out.finish_reason != "tool_calls" or gen.stop_requested:
                    break
                tools_started(run, [c.name for c in calls])  # hold or evict the round's KV cache meanwhile
                messages = await self._run_tools(gen, run, messages, "".join(text), calls, out)
                if gen.stop_requested:
                    raise GenerationStopped
                await run.resume(ChatPrompt(messages), f"{gen.message_id}-round-{round_no + 1}")
        except (GenerationStopped, ConversationDeleted, SummaryAborted):
            out.finish_reason = "abort"
        except BudgetSpent:  # the tokens reserved before the answer began are used up: cut, like max_tokens
            out.finish_reason = "length"
        except (ApiError, BadGenerationRequest, BackendError) as exc:  # queue timeout, backend
            out.error = exc
        except asyncio.CancelledError:
            out.finish_reason = "abort"
            await self._finish(gen, out)
            raise
        except LogTakenOver:
            await self._another_writer(gen, out)
        except Exception as exc:  # keep the job's failure in the conversation, not in a log nobody reads
            log.exception("generation %s failed", gen.message_id)
            out.error = exc
        await self._finish(gen, out)

    @staticmethod
    def _final_prompt(run: Run, messages: list[dict], prefix: str) -> ChatPrompt:
        """Messages as sent: the tool list joins the system message; the text so far opens the answer."""
        rendered = render_messages(messages, run.ask.tools)
        if prefix:
            return ChatPrompt(rendered + [{"role": "assistant", "content": prefix}], continue_final=True)
        return ChatPrompt(rendered)

    async def _first_prompt(self, gen: Generation) -> ChatPrompt:
        """The first round's prompt: as planned before the answer started, once its summary is written
        (within the tokens reserved for it); planned here for an answer taken over from another gateway."""
        run = gen.run
        if gen.prompt is not None:
            return gen.prompt
        draft, limit = gen.draft, gen.prompt_tokens
        if draft is None:  # taken over: its reservation was adopted, nothing to fit
            draft, limit = self.prompts.plan(*await self.prompts.load(gen.conversation_id, gen.user_message_id),
                                             run.max_tokens, system=await self.prompts.system_for(run.ask.user.id)
                                             ), self.prompts.context_window - run.max_tokens
        summary = await self.prompts.write_summary(draft, gen.conversation_id, run.limits.model, gen.next_summary_id,
                                                   run.charge, lambda request: admitted_summary(run, request))

        def count(messages: list[dict]) -> int:
            return run.prompt_tokens(self._final_prompt(run, messages, gen.prefix))

        messages = self.prompts.build(draft, summary, count, limit)
        if summary is not None and count(messages) > limit:  # a summary longer than allowed for: without it
            messages = self.prompts.build(draft, None, count, limit)
        return self._final_prompt(run, messages, gen.prefix)

    async def _run_tools(self, gen: Generation, run: Run, messages: list[dict], text: str, calls: list[ToolCall],
                         out: Outcome) -> list[dict]:
        """Run a round's calls; the prompt for the next round (the round's turn, then one turn per result)."""
        cited = list(gen.citations or [])  # file_search numbers its passages after these, and adds them
        ctx = ToolContext(run.ask.user, self.db, gen.conversation_id, self.blobs, self.settings, cited)
        budget = self.settings.chat.max_tool_calls_per_answer
        turns = [{"role": "assistant", "content": "\n".join([text] * bool(text) + [c.text() for c in calls])}]
        for call in calls:
            if len(out.steps) >= budget:
                result_event = {"id": call.id, "name": call.name, "output": "",
                                "error": f"the limit of {budget} tool calls per answer is reached"}
                model_text = f"error: {result_event['error']}"
            else:
                started = time.monotonic()
                result = await self.tools.run(call, ctx)
                self.pipeline.traffic.metrics.observe_tool(call.name if call.name in self.tools.tools else "mcp",
                                                           time.monotonic() - started, result.error is not None)
                result_event, model_text = result.event(), result.model_text()
            out.steps.append({"arguments": call.arguments, **result_event})
            await gen.log.append({"tool_result": result_event})
            turns.append({"role": "tool", "content": model_text})
        gen.citations = cited or None
        if len(out.steps) >= budget:  # no more calls: the next round is read as plain text
            run.ask = replace(run.ask, tools=replace(run.ask.tools, choice="none"))
        return messages + turns

    @staticmethod
    async def _write(gen: Generation, piece: object, out: Outcome) -> None:
        if isinstance(piece, ToolCall):
            await gen.log.append({"tool_call": {"id": piece.id, "name": piece.name, "arguments": piece.arguments}})
        # PostgreSQL text cannot hold NUL: drop it here, so what is streamed is exactly what is saved.
        elif isinstance(piece, AnswerText):
            text = piece.text.replace("\x00", "")
            out.answer.append(text)
            await gen.log.append({"token": text}, answer_tokens=gen.answer_tokens())
        elif isinstance(piece, Thinking):
            text = piece.text.replace("\x00", "")
            out.thinking.append(text)
            await gen.log.append({"thinking": text})
        elif isinstance(piece, Finished):
            out.finish_reason = piece.finish_reason

    async def _finish(self, gen: Generation, out: Outcome) -> None:
        if not gen.abandoned and await self._taken_over(gen):
            # Its lease lapsed while it ran here (Redis restarted without its data, say) and another
            # gateway continued it: that one saves, settles and meters it. Doing it here too bills twice.
            log.warning("answer %s was taken over by another gateway; it ends here unsaved", gen.message_id)
            gen.abandoned = True
        if gen.abandoned:  # another gateway has the job: it saves the answer and settles the quota
            self._end_unsaved(gen)
            return
        release_kv(gen.run)  # no resume follows: what the last round kept is freed
        lost = False
        try:
            await gen.log.flush()  # every journal write done before the final save replaces them
            reason = out.finish_reason or ("error" if out.error else "abort")
            status = "error" if out.error else STATUS_FOR_FINISH.get(reason, "incomplete")
            outcome = await self._save(gen, out, reason, status)
            if outcome == LOST:
                # The job changed hands after the check above: the database's fence (final_save.py) let the
                # gateway that has the answer now save it, and it settles the reservation it adopted.
                log.warning("answer %s was taken over or ended elsewhere before its save; it ends here unsaved",
                            gen.message_id)
                gen.abandoned = lost = True
                self._end_unsaved(gen)
                return
            # Settle (and meter, where the save could not), after the database said who saves the answer,
            # and before the client hears 'done'.
            await gen.run.close(metered=outcome == SAVED)
            if out.error is not None:
                await gen.log.append({**error_event(out.error), "message_id": gen.message_id}, event="error")
            else:
                usage: Usage = gen.run.usage
                await gen.log.append({
                    "done": True, "message_id": gen.message_id, "user_message_id": gen.user_message_id,
                    "conversation_id": gen.conversation_id, "status": status, "finish_reason": reason,
                    "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": gen.answer_tokens()},
                    **({"citations": gen.citations} if gen.citations else {})})
        finally:
            if not lost:
                await self._end_saved(gen)

    async def _save(self, gen: Generation, out: Outcome, reason: str, status: str) -> str:
        """The answer's outcome and its usage, saved in one transaction if this process still writes it."""
        text = "".join(out.answer)
        values = {"text": text, "tokens": self._count(text), "status": status,
                  "reasoning": "".join(out.thinking) or None, "tool_steps": out.steps or None,
                  "finish_reason": None if out.error else reason, "interrupted_reason": None,
                  "prompt_tokens": gen.run.usage.prompt_tokens or None, "completion_tokens": gen.answer_tokens()}
        if gen.citations:
            values["citations"] = gen.citations
        if out.error is not None:
            values["error"] = str(out.error) or type(out.error).__name__
        run, used = gen.run, gen.run.used
        metered = Metered(run.ask.user.id, run.limits.model, used) if used.total_tokens and not run.gave_way else None
        try:
            return await save_answer(self.db, gen.message_id, gen.conversation_id, self.jobs.instance, values, metered)
        except Exception:
            log.exception("could not save the answer %s", gen.message_id)
            return UNSAVED

    def _end_unsaved(self, gen: Generation) -> None:
        """End here with nothing saved, settled or metered: another gateway has the answer."""
        gen.log.discard()
        gen.run.drop()
        if self._running.get(gen.conversation_id) is gen:
            del self._running[gen.conversation_id]
        gen.finished.set()

    async def _end_saved(self, gen: Generation) -> None:
        """Close the log and let the job go."""
        try:
            await gen.log.close()
            try:
                await self.logs.pointer_ended(gen.conversation_id, gen.message_id)
            except Exception as exc:  # harmless: the pointer keeps an open log's expiry
                log.warning("could not shorten the stream pointer of %s: %s", gen.conversation_id, exc)
        finally:
            if self._running.get(gen.conversation_id) is gen:
                del self._running[gen.conversation_id]
            gen.finished.set()
            try:
                await self.jobs.release(gen.conversation_id)
            except Exception as exc:  # Redis away: the lease lapses, and the keeper finds the answer saved
                log.warning("could not release the job of %s: %s", gen.conversation_id, exc)

    async def _taken_over(self, gen: Generation) -> bool:
        """Whether another gateway holds this answer's job now."""
        try:
            holder = await self.jobs.holder(gen.conversation_id)
        except Exception:  # Redis away: nobody can have taken it meanwhile without it
            return False
        return holder is not None and holder.gateway != self.jobs.gateway

    def _count(self, text: str) -> int:
        try:
            return self.backend.count_tokens(text) if text else 0
        except BackendError:
            return 0
