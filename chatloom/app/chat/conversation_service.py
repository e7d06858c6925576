"""Conversations: save the user's message, then run the answer as a background job.

A generation is a job, not a connection: it writes its events to an event log and saves the
answer when it ends, whether or not any client is still reading. One generation runs per
conversation at a time (across gateways: `jobs`); POST .../stop aborts it and the partial answer is
kept as 'stopped'. A gateway that dies mid-answer has its answers taken over by another gateway and
continued from their logged text (`resume_job`, see state/job_keeper.py and takeover.py).

The generation's trip (caps, moderation, quota, admission, stream, output guard, settlement) is the
shared `Pipeline`; this service adds what is particular to conversations: the message tree, prompt
assembly with summaries (conversation_prompt.py), the event log and the saved answer.

Quota: before the response starts, the answer's prompt is planned and counted as it will be sent
(system prompt, summary, turns, tool descriptions, thinking instructions) and that is what is reserved,
with max_tokens, the tool rounds (settings.chat.tool_rounds_reserved) and an allowance for a summary still
to be written (`reserve_answer`). The job then never asks the quota for more for the answer, so an
over-quota message is always a 429, never an error inside the stream (docs/quotas.md).

The service is one object in four modules: this one starts answers (send, regenerate);
answer_job.py runs each answer to its end; stopping.py stops them; takeover.py continues the
answers of a gateway that died.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.chat.answer_job import AnswerJob, Generation
from chatloom.app.chat.branches import Tree
from chatloom.app.chat.conversation_prompt import Draft, PromptAssembler, branch_turns
from chatloom.app.chat.message_images import delete_blobs, image_tokens, save_images
from chatloom.app.chat.prompt import Turn
from chatloom.app.chat.recall import relevant_turns
from chatloom.app.chat.resend import AlreadySent
from chatloom.app.chat.stopping import Stopping
from chatloom.app.chat.takeover import TakeOver
from chatloom.app.tools.builtins import builtin_registry
from chatloom.app.tools.registry import ToolRegistry
from chatloom.app.core.errors import ApiError, not_found
from chatloom.app.core.validation import off_loop
from chatloom.app.files.retrieval import Passage, Retriever, citations, context_text
from chatloom.app.generation.pipeline import Ask, ChatPrompt, Pipeline, Run
from chatloom.app.generation.tool_calls import ToolUse
from chatloom.app.state.answer_journal import AnswerJournal, JournaledLog
from chatloom.app.state.events import EventLogStore
from chatloom.app.state.job_keeper import reservation_spec
from chatloom.app.state.jobs import JobRecord, Jobs, MemoryJobs
from chatloom.settings import Settings
from chatloom.serving.images import ImageData
from chatloom.store import Conversation, Conversations, Database, Messages, User
from chatloom.store.blobs import BlobStore

UNSET = object()


@dataclass
class GenerationOptions:
    user: User  # the caller: their tier sets quotas, caps and queue priority
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    reasoning_effort: str | None = None  # low | medium | high: think before answering
    tools: ToolUse | None = None  # the chat tools the model may call (set by the service)

    def ask(self, request_id: str) -> Ask:
        return Ask(user=self.user, model=self.model, max_tokens=self.max_tokens, temperature=self.temperature,
                   reasoning_effort=self.reasoning_effort, request_id=request_id, param="text", tools=self.tools)


class ConversationService(AnswerJob, Stopping, TakeOver):
    """Starts, runs, stops and takes over the answers of conversations."""

    def __init__(self, db: Database, pipeline: Pipeline, settings: Settings, logs: EventLogStore,
                 blobs: BlobStore | None = None, retriever: Retriever | None = None) -> None:
        self.db = db
        self.retriever = retriever  # passages of the conversation's files for each new message
        self.pipeline = pipeline
        self.backend = pipeline.backend
        self.settings = settings
        self.logs = logs
        self.journal = AnswerJournal(db)
        self.blobs = blobs
        self.prompts = PromptAssembler(db, pipeline.backend, settings, lambda: pipeline.context_window, blobs)
        self._running: dict[str, Generation | None] = {}
        self.jobs: Jobs = MemoryJobs()  # which gateway runs each conversation's answer (Redis: the fleet)
        self.draining = False  # shutting down: no new answers here
        names = [n.strip() for n in settings.chat.tools.split(",") if n.strip()]
        self.tools: ToolRegistry = builtin_registry(names, settings, db, retriever)
        self.blobs = blobs  # where tools keep the files they produce

    # -- starting generations ----------------------------------------------------------
    def running(self, conversation_id: str) -> Generation | None:
        return self._running.get(conversation_id)

    def running_count(self) -> int:
        return sum(1 for g in self._running.values() if g is not None)

    def _claim(self, conversation_id: str) -> None:
        if conversation_id in self._running:
            raise ApiError(409, "an answer is already being generated in this conversation; stop it first",
                           "generation_in_progress")
        # A placeholder until the generation exists, so two requests cannot both pass the check.
        self._running[conversation_id] = None

    def _unclaim(self, conversation_id: str) -> None:
        if conversation_id in self._running and self._running[conversation_id] is None:
            del self._running[conversation_id]

    async def _claim_fleet(self, conversation_id: str) -> bool:
        """Hold the conversation across the fleet: another gateway may be answering in it."""
        if self.draining:
            raise ApiError(503, "this gateway is shutting down; retry (another gateway will answer)",
                           "shutting_down", headers={"Retry-After": "1"})
        if not await self.jobs.claim(conversation_id):
            raise ApiError(409, "an answer is already being generated in this conversation (on another "
                           "gateway); stop it first", "generation_in_progress")
        return True

    async def send(self, session: AsyncSession, conv: Conversation, text: str, options: GenerationOptions,
                   parent_id: object = UNSET, images: list[ImageData] | tuple = (),
                   client_key: str | None = None) -> Generation:
        """Save a user message (under parent_id, or at the end of the active branch), with `images` (read
        and checked; kept with the message), and start its answer. With `client_key` (the request's
        Idempotency-Key), AlreadySent when another send with that key stored its message first."""
        if images and self.blobs is None:
            raise ApiError(400, "this server keeps no images in conversations", "unsupported_content", "images")
        if len(text) > self.settings.chat.max_message_chars:
            raise ApiError(400, f"the message is too long: {len(text)} characters, at most "
                           f"{self.settings.chat.max_message_chars} allowed", "message_too_long", "text")
        conversation_id = conv.id  # read now: a failed write leaves the row unreadable until a rollback
        self._claim(conv.id)
        run = None
        claimed = False
        try:
            claimed = await self._claim_fleet(conv.id)
            tree = Tree(await Messages(session).all_in(conv.id))
            parent = self._parent(tree, conv, parent_id)
            run = await self.pipeline.open((await self._with_tools(options, session)).ask(""), moderate=text)  # before model work
            text_tokens = await off_loop(self.backend.count_tokens, text, size=len(text))  # large input
            if images:  # a turn's stored count includes its images' tokens
                text_tokens += await asyncio.to_thread(image_tokens, self.backend, text, list(images))
            self.prompts.check_fits(text_tokens, run.max_tokens)
            history, summary = branch_turns(tree.path_to(parent) if parent is not None else [], conv.summary,
                                            conv.summary_upto)
            passages = await self._passages(session, options.user, conv.id, text)
            recall = await self._older_turns(session, conv.id, tree.path_to(parent) if parent is not None else [],
                                             text)
            history = await self.prompts.with_images(session, history)
            planned = await self.reserve_answer(run, history + [Turn("", "user", text, text_tokens, tuple(images))],
                                                summary, context=context_text(passages), session=session,
                                                recall=recall)
            messages = Messages(session)
            user_msg = await messages.add(conv.id, parent, "user", text, text_tokens, client_key=client_key)
            if images:
                written = await save_images(session, self.blobs, options.user.id, user_msg.id, list(images))
            answer = await messages.add(conv.id, user_msg.id, "assistant", "", 0, run.limits.model,
                                        status="incomplete", writer=self.jobs.instance)
            values = {"current_leaf_id": answer.id}
            if conv.title is None and not tree.by_id:
                values["title"] = make_title(text, self.settings.chat.title_chars)
            await Conversations(session).touch(conv.id, **values)
            try:
                await session.commit()
            except BaseException:
                if images:  # nothing half-written: the rows were not saved, so neither are the bytes
                    await asyncio.to_thread(delete_blobs, self.blobs, written)
                raise
            return await self._start(conv.id, user_msg.id, answer.id, run, planned=planned,
                                     citations=citations(passages))
        except IntegrityError:
            await self._write_refused(session, conversation_id, claimed, run, client_key)
            raise
        except BaseException:
            await self._give_back(conv.id, claimed, run)
            raise

    async def _passages(self, session: AsyncSession, user: User, conversation_id: str, text: str) -> list[Passage]:
        """The passages of the conversation's files for this message (none without a retriever or files),
        read in the request's own session."""
        if self.retriever is None:
            return []
        return await self.retriever.for_conversation(user, conversation_id, text, session=session)

    async def _older_turns(self, session: AsyncSession, conversation_id: str, path: list,
                           text: str) -> list[tuple[int, Turn]]:
        """The earlier turns of the branch (`path`, root first) most relevant to the new message `text`,
        best first with their places (chat.older_turns: none when only the summary stands for them)."""
        if self.settings.chat.older_turns == "summary" or self.settings.chat.retrieved_turns_tokens <= 0:
            return []
        return await relevant_turns(session, conversation_id, [Turn(m.id, m.role, m.text, m.tokens) for m in path],
                                    text)

    async def _with_tools(self, options: GenerationOptions, session: AsyncSession) -> GenerationOptions:
        if not self.tools or options.reasoning_effort is not None:  # tools and thinking are not mixed
            return options
        tools = await self.tools.refresh(options.user, session)  # the MCP servers' tools as they are now
        if not tools.tools:
            return options
        return GenerationOptions(options.user, options.model, options.max_tokens, options.temperature,
                                 options.reasoning_effort, tools)

    @staticmethod
    def _parent(tree: Tree, conv: Conversation, parent_id: object) -> str | None:
        if parent_id is UNSET:
            return tree.default_leaf(conv.current_leaf_id)
        if parent_id is None:
            return None
        if parent_id not in tree:
            raise ApiError(400, f"parent_id {parent_id!r} is not a message of this conversation",
                           "invalid_parent", "parent_id")
        if tree.by_id[parent_id].role != "assistant":
            raise ApiError(400, "parent_id must be an assistant message (to edit a message, send the new text "
                           "with the edited message's parent_id)", "invalid_parent", "parent_id")
        return parent_id  # type: ignore[return-value]

    async def regenerate(self, session: AsyncSession, conv: Conversation, message_id: str,
                         options: GenerationOptions, client_key: str | None = None) -> Generation:
        """A new answer beside an assistant message (or under a user message). With `client_key` (the
        request's Idempotency-Key, kept with the new answer), AlreadySent when another regeneration with
        that key stored its answer first."""
        conversation_id = conv.id  # read now: a failed write leaves the row unreadable until a rollback
        self._claim(conv.id)
        run = None
        claimed = False
        try:
            claimed = await self._claim_fleet(conv.id)
            run = await self.pipeline.open((await self._with_tools(options, session)).ask(""))
            target = await Messages(session).get(conv.id, message_id)
            if target is None:
                raise not_found("message")
            question_id = target.id if target.role == "user" else target.parent_id
            if question_id is None:
                raise ApiError(400, "this message has no user message to answer", "invalid_message")
            tree = Tree(await Messages(session).all_in(conv.id))
            question = tree.by_id[question_id].text
            passages = await self._passages(session, options.user, conv.id, question)
            recall = await self._older_turns(session, conv.id, tree.path_to(question_id)[:-1], question)
            planned = await self.reserve_answer(run, *branch_turns(tree.path_to(question_id), conv.summary,
                                                                    conv.summary_upto), context=context_text(passages),
                                                session=session, recall=recall)
            answer = await Messages(session).add(conv.id, question_id, "assistant", "", 0, run.limits.model,
                                                 status="incomplete", writer=self.jobs.instance,
                                                 client_key=client_key)
            await Conversations(session).touch(conv.id, current_leaf_id=answer.id)
            await session.commit()
            return await self._start(conv.id, question_id, answer.id, run, planned=planned,
                                     citations=citations(passages))
        except IntegrityError:
            await self._write_refused(session, conversation_id, claimed, run, client_key)
            raise
        except BaseException:
            await self._give_back(conversation_id, claimed, run)
            raise

    async def _write_refused(self, session: AsyncSession, conversation_id: str, claimed: bool, run: Run | None,
                             client_key: str | None) -> None:
        """The database refused a send's or regeneration's rows: roll back, give back what was taken, and
        raise AlreadySent when the refusal was another request having stored the same Idempotency-Key."""
        await session.rollback()
        await self._give_back(conversation_id, claimed, run)
        if client_key is not None and await Messages(session).by_client_key(conversation_id, client_key):
            raise AlreadySent() from None

    async def _give_back(self, conversation_id: str, claimed: bool, run: Run | None) -> None:
        """Undo what send or regenerate took before its job started: the claim, the job lease, the run."""
        self._unclaim(conversation_id)
        if claimed:
            await self.jobs.release(conversation_id)
        if run is not None:
            await run.close()

    async def reserve_answer(self, run: Run, history: list[Turn], summary: str | None, prefix: str = "",
                              context: str = "", session: AsyncSession | None = None,
                              recall: list[tuple[int, Turn]] | None = None) -> tuple[ChatPrompt | None, Draft, int]:
        """Plan the answer's prompt (no model work) and reserve its quota, before any response: the prompt
        exactly as it will be sent when no summary has to be written first, else an upper bound of it plus
        an allowance for the summary; and, with tools, the rounds after the first. Raises the 400, 429 or
        503 of `Run.reserve`. Returns (the prompt or None, the draft, the tokens reserved for the prompt)
        for `_start`. `prefix`: the answer's text so far, which the prompt continues; `context`: retrieved
        passages for the system message; `session`: the caller's, to read the user's instructions and
        memories in; `recall`: earlier turns relevant to the new message (PromptAssembler.plan)."""
        limit = self.prompts.context_window - run.max_tokens

        def count(messages: list[dict]) -> int:
            return run.prompt_tokens(self._final_prompt(run, messages, prefix))

        system = await self.prompts.system_for(run.ask.user.id, session)

        def plan() -> tuple[ChatPrompt | None, Draft, int]:
            bare = [{"role": "system", "content": system}]
            extra = count(bare) - self.backend.count_prompt_tokens(bare)  # tools, thinking, the prefix
            draft = self.prompts.plan(history, summary, run.max_tokens, extra, context=context, system=system,
                                      recall=recall)
            if draft.pending:
                return None, draft, self.prompts.bound(draft, count, limit)
            prompt = self._final_prompt(run, self.prompts.build(draft, draft.summary, count, limit), prefix)
            return prompt, draft, run.prompt_tokens(prompt)  # counted once: reserve() and admit() reuse it

        size = sum(len(t.text) for t in history) + len(prefix) + len(summary or "") + len(context)
        prompt, draft, tokens = await off_loop(plan, size=size)  # a long branch is counted off the event loop
        tools = run.ask.tools is not None and run.ask.tools.active
        await run.reserve(prompt if prompt is not None else tokens,
                          extra_rounds=self.settings.chat.tool_rounds_reserved if tools else 0,
                          summaries=draft.summary_tokens)
        return prompt, draft, tokens

    async def _start(self, conversation_id: str, question_id: str, answer_id: str, run: Run,
                     prefix: str = "", planned: tuple[ChatPrompt | None, Draft, int] | None = None,
                     citations: list[dict] | None = None) -> Generation:
        run.request_id = answer_id  # stop() and the engine know the answer by its message id
        gen = Generation(conversation_id, question_id, answer_id, run,
                         JournaledLog(await self.logs.create(answer_id), self.journal, answer_id), prefix=prefix)
        if planned is not None:
            gen.prompt, gen.draft, gen.prompt_tokens = planned
        gen.citations = citations
        await self.logs.set_pointer(conversation_id, answer_id)  # for GET /conversations/{id}/stream
        await self.jobs.update(JobRecord(conversation_id, self.jobs.gateway, answer_id, spec={
            "user_message_id": question_id, "user_id": run.ask.user.id, "model": run.limits.model,
            "max_tokens": run.max_tokens, "temperature": run.limits.temperature, "top_p": run.limits.top_p,
            "effort": run.limits.effort, "reservation": reservation_spec(run.reservation)}))
        self._running[conversation_id] = gen
        gen.task = asyncio.create_task(self._run(gen), name=f"generation-{answer_id}")
        return gen


def make_title(text: str, limit: int = 60) -> str:
    """The first line of the first message, cut at a word boundary."""
    line = re.sub(r"\s+", " ", text.strip().splitlines()[0] if text.strip() else "").strip()
    if len(line) <= limit:
        return line or "New chat"
    cut = line[:limit].rsplit(" ", 1)[0] if " " in line[:limit] else line[:limit]
    return cut.rstrip(" ,.;:") + "…"
