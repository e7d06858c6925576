"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions (streamed or not) and /v1/models.

A format adapter over the shared generation pipeline: the request becomes an `Ask` and a prompt,
the pipeline's pieces become OpenAI's chunks or its whole response. Stateless: nothing is stored,
and the generation is tied to the connection (a client that goes away aborts it). Errors use
OpenAI's shape so the official SDKs raise their usual exceptions.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.background import BackgroundTask

from chatloom.app.api.deps import AppContext, Ctx, CurrentUser, SessionDep
from chatloom.app.core.errors import ApiError, error_body
from chatloom.app.api.openai_logprobs import CompletionLogprobs, chat_logprobs, join_blocks
from chatloom.app.core.image_input import ImageReader, reading_images, require_vision
from chatloom.app.api.web_search_options import searched, url_citations
from chatloom.app.api.openai_out import CapabilitiesOut, ChatCompletionOut, CompletionOut, ModelList, ModelOut
from chatloom.app.api.openai_schemas import ChatCompletionIn, CompletionIn, SamplingIn, prompt_text
from chatloom.app.api.openapi_responses import OPENAI_ANSWER, SIGNED_IN, errors, openai_stream
from chatloom.app.generation.pipeline import (AnswerText, Ask, Choice, Finished, Piece, Prompt, PromptLogprobs, Run,
                                              Thinking, ToolCall)
from chatloom.app.api.run_start import begin_run, reserve_run, start_run
from chatloom.app.api.sse import SSE_HEADERS, EventStreamResponse, frame
from chatloom.serving import BackendError, BadGenerationRequest, Usage
from chatloom.store import User
from chatloom.serving.backend import TextLogprob

router = APIRouter(prefix="/v1", tags=["openai"])


def _usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("length", "content_filter", "tool_calls") else "stop"


def _call_out(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class _Choice:
    """What one choice has said so far, for a whole (not streamed) answer."""

    def __init__(self) -> None:
        self.answer: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[ToolCall] = []
        self.logprobs: list[TextLogprob] = []
        self.prompt_logprobs: list[TextLogprob] = []
        self.finish_reason = "stop"

    def add(self, piece: Piece) -> None:
        if isinstance(piece, AnswerText):
            self.answer.append(piece.text)
            self.logprobs += piece.logprobs
        elif isinstance(piece, Thinking):
            self.thinking.append(piece.text)
        elif isinstance(piece, ToolCall):
            self.calls.append(piece)
        elif isinstance(piece, PromptLogprobs):
            self.prompt_logprobs = list(piece.entries)
        elif isinstance(piece, Finished):
            self.finish_reason = _finish_reason(piece.finish_reason)


class _ChatFormat:
    """chat.completion(.chunk) objects; the thinking goes in reasoning_content, as vLLM sends it.
    A tool call streams as OpenAI's deltas: one with its index, id and name, then its arguments."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, reasoning: bool, logprobs: bool, sources: list[dict] | None = None) -> None:
        self.reasoning = reasoning
        self.want_logprobs = logprobs
        self.sources = sources  # web_search_options' results: the whole message's url_citation annotations
        self.calls_sent: dict[int, int] = {}  # by choice

    def tool_call_chunks(self, index: int, call: ToolCall) -> list[dict]:
        n = self.calls_sent[index] = self.calls_sent.get(index, -1) + 1
        head = {"index": n, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        return [{"delta": {"tool_calls": [head]}},
                {"delta": {"tool_calls": [{"index": n, "function": {"arguments": call.arguments}}]}}]

    def opening(self, index: int) -> dict | None:
        return {"delta": {"role": "assistant", "content": ""}}

    def text_field(self, piece: Piece) -> str | None:
        """The delta field a text piece goes in (None: not sent)."""
        if isinstance(piece, AnswerText):
            return "content"
        if isinstance(piece, Thinking):
            return "reasoning_content"
        return None

    def text_choice(self, field: str, text: str) -> dict:
        return {"delta": {field: text}}

    def logprobs(self, index: int, entries: list[TextLogprob]) -> dict:
        return chat_logprobs(entries)

    def prompt_chunk(self, index: int, entries: list[TextLogprob] | None) -> dict | None:
        return None

    def closing(self, reason: str) -> dict:
        return {"delta": {}, "finish_reason": reason}

    def whole(self, index: int, c: _Choice) -> dict:
        message = {"role": "assistant", "content": "".join(c.answer) or (None if c.calls else ""), "refusal": None}
        if c.calls:
            message["tool_calls"] = [_call_out(call) for call in c.calls]
        if self.reasoning:
            message["reasoning_content"] = "".join(c.thinking)
        if self.sources is not None:
            message["annotations"] = url_citations(message["content"] or "", self.sources)
        return {"message": message, "finish_reason": c.finish_reason,
                "logprobs": chat_logprobs(c.logprobs) if self.want_logprobs else None}


class _CompletionFormat:
    """text_completion objects; with `echo`, each choice's text begins with its prompt (`echoes`, by
    prompt), and its logprobs with the prompt's where they were asked."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, logprobs: bool, echoes: list[str] | None, n: int) -> None:
        self.want_logprobs = logprobs
        self.echoes = echoes
        self.n = n
        self._blocks: dict[int, CompletionLogprobs] = {}  # by choice

    def opening(self, index: int) -> dict | None:
        if self.echoes is None or self.want_logprobs:  # with logprobs, the echo waits for the prompt's
            return None
        return {"text": self.echoes[index // self.n]}

    def text_field(self, piece: Piece) -> str | None:
        return "text" if isinstance(piece, AnswerText) else None

    def text_choice(self, field: str, text: str) -> dict:
        return {field: text}

    def logprobs(self, index: int, entries: list[TextLogprob]) -> dict:
        return self._blocks.setdefault(index, CompletionLogprobs()).block(entries)

    def prompt_chunk(self, index: int, entries: list[TextLogprob] | None) -> dict | None:
        if self.echoes is None:
            return None
        return {"text": self.echoes[index // self.n], "logprobs": self.logprobs(index, entries or [])}

    def closing(self, reason: str) -> dict:
        return {"text": "", "finish_reason": reason}

    def tool_call_chunks(self, index: int, call: ToolCall) -> list[dict]:
        return []

    def whole(self, index: int, c: _Choice) -> dict:
        text = "".join(c.answer)
        logprobs = None
        if self.echoes is not None:
            text = self.echoes[index // self.n] + text
        if self.want_logprobs:
            block = CompletionLogprobs()
            logprobs = join_blocks([block.block(c.prompt_logprobs), block.block(c.logprobs)])
        return {"text": text, "finish_reason": c.finish_reason, "logprobs": logprobs}


_MARK = "\u0000chatloom-text\u0000"
_MARK_JSON = json.dumps(_MARK).encode()


class _TextChunks:
    """The SSE bytes of a stream's text chunks. Consecutive chunks differ only in their text, so the
    JSON around it is encoded once per field and choice, and each token costs one json.dumps of its
    own text (the bytes are the same as `chunk(...)` would give: a JSON string never holds a raw newline)."""

    def __init__(self, chunk: Callable[[dict, int], bytes], fmt) -> None:
        self._chunk = chunk
        self._fmt = fmt
        self._frames: dict[tuple[str, int], tuple[bytes, bytes]] = {}

    def __call__(self, field: str, text: str, index: int = 0) -> bytes:
        parts = self._frames.get((field, index))
        if parts is None:
            head, tail = self._chunk(self._fmt.text_choice(field, _MARK), index).split(_MARK_JSON)
            parts = self._frames[(field, index)] = (head, tail)
        return parts[0] + json.dumps(text, ensure_ascii=False).encode() + parts[1]


Started = tuple[Run, AsyncIterator[Choice], Choice | None]


async def _start_all(ctx: AppContext, parts: list[tuple[Ask, Prompt, str]], session: AsyncSession) -> list[Started]:
    """Start a run per prompt. Every prompt is checked and reserved first, so that a refusal of any (too
    long, over quota) leaves nothing started; then all are admitted and started at once. On any failure
    (or a cancelled request) the runs are closed and the failure raised."""
    if len(parts) == 1:
        ask, prompt, text = parts[0]
        return [await start_run(ctx.pipeline, ask, prompt, text, session, by_choice=True)]
    runs: list[Run] = []
    try:
        for ask, prompt, text in parts:
            runs.append(await reserve_run(ctx.pipeline, ask, prompt, text))
    except BaseException:
        for run in runs:
            await run.close()
        raise
    tasks = [asyncio.ensure_future(begin_run(run, prompt, session, by_choice=True))
             for run, (_, prompt, _) in zip(runs, parts)]
    try:
        await asyncio.wait(tasks)
        failed = next((t.exception() for t in tasks if t.exception() is not None), None)
        if failed is not None:
            raise failed
        return [t.result() for t in tasks]
    except BaseException:
        for t in tasks:
            t.cancel()  # a run still starting closes itself (begin_run)
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close([t.result() for t in tasks if not t.cancelled() and t.exception() is None])
        raise


async def _pieces(started: list[Started], n: int) -> AsyncIterator[tuple[int, Piece]]:
    """Every run's pieces, run after run (their engines work meanwhile), as (choice index, piece): choice
    j of prompt i is i * n + j."""
    for i, (_, pieces, first) in enumerate(started):
        choice = first
        while choice is not None:
            yield i * n + choice.index, choice.piece
            choice = await anext(pieces, None)


async def _close(started: list[Started]) -> None:
    for run, pieces, _ in started:
        await pieces.aclose()  # a client that left aborts the request
        await run.close()


async def _respond(ctx: AppContext, body: SamplingIn, parts: list[tuple[Ask, Prompt, str]], fmt,
                   session: AsyncSession):
    started = await _start_all(ctx, parts, session)
    n = parts[0][0].n
    run = started[0][0]
    base = {"id": run.request_id, "object": fmt.object, "created": int(time.time()), "model": run.limits.model,
            "system_fingerprint": None}

    def usage() -> dict:
        return _usage(sum((r.usage for r, _, _ in started), Usage()))

    if not body.stream:
        choices = [_Choice() for _ in range(len(started) * n)]
        try:
            async for index, piece in _pieces(started, n):
                choices[index].add(piece)
        finally:
            await _close(started)
        return JSONResponse({**base, "choices": [{"index": i, **fmt.whole(i, c)} for i, c in enumerate(choices)],
                             "usage": usage()})

    include_usage = body.include_usage

    def chunk(choice: dict, index: int = 0) -> bytes:
        data = {**base, "object": fmt.chunk_object,
                "choices": [{"index": index, "logprobs": None, "finish_reason": None, **choice}]}
        if include_usage:
            data["usage"] = None
        return frame(data)

    text_chunk = _TextChunks(chunk, fmt)

    async def events():
        ended = False  # the answer went out whole: the runs are closed after the response (see below)
        try:
            for index in range(len(started) * n):
                if (opening := fmt.opening(index)) is not None:
                    yield chunk(opening, index)
            async for index, piece in _pieces(started, n):
                if isinstance(piece, Finished):
                    yield chunk(fmt.closing(_finish_reason(piece.finish_reason)), index)
                elif isinstance(piece, ToolCall):
                    for choice in fmt.tool_call_chunks(index, piece):
                        yield chunk(choice, index)
                elif isinstance(piece, PromptLogprobs):
                    if (echo := fmt.prompt_chunk(index, list(piece.entries))) is not None:
                        yield chunk(echo, index)
                elif (field := fmt.text_field(piece)) is not None:
                    if isinstance(piece, AnswerText) and piece.logprobs:
                        yield chunk({**fmt.text_choice(field, piece.text),
                                     "logprobs": fmt.logprobs(index, list(piece.logprobs))}, index)
                    else:
                        yield text_chunk(field, piece.text, index)
            for r, _, _ in started:
                await r.release()  # the user's next request may start as soon as this one's stream ends
            if include_usage:
                yield frame({**base, "object": fmt.chunk_object, "choices": [], "usage": usage()})
            ended = True
        except (BadGenerationRequest, BackendError) as exc:
            yield frame(error_body(500, f"generation failed: {exc}", "generation_failed"))
        finally:
            if ended:
                for _, pieces, _ in started:
                    await pieces.aclose()
            else:
                await _close(started)
        yield frame("[DONE]")

    # Closing a run meters its usage in the database (a commit: 3-6 ms measured on SQLite), which the
    # client would otherwise wait for before its stream ends; it runs once the response is complete.
    # (Run.close is idempotent: where the stream was cut short, the generator has closed the runs already.)
    return EventStreamResponse(events(), headers=SSE_HEADERS, background=BackgroundTask(_close_runs, started))


async def _close_runs(started: list[Started]) -> None:
    for run, _, _ in started:
        await run.close()


@router.post("/chat/completions", responses=openai_stream("chat.completion.chunk", ChatCompletionOut) | OPENAI_ANSWER)
async def chat_completions(body: ChatCompletionIn, ctx: Ctx, user: CurrentUser, session: SessionDep):
    return await chat_answer(ctx, body, user, session)


async def chat_answer(ctx: AppContext, body: ChatCompletionIn, user: User, session: AsyncSession, batch: bool = False):
    """The chat completion route's answer; `batch`: run in the batch class (the Batch API's lines)."""
    tools = body.tool_use()
    if body.has_images():  # a model that takes none is named before any image is read
        require_vision(ctx.backend, body.model)
    reader = ImageReader(ctx.settings.vision, "messages")
    if body.has_images():
        await reader.fetch(body.image_urls())
    prompt = await reading_images(body.has_images(), body.prompt, tools, reader)
    ask = replace(body.to_ask(user, f"chatcmpl-{uuid.uuid4().hex}", tools), batch=batch)
    sources = None
    if body.web_search_options is not None:
        await session.close()  # no connection held while the search runs
        prompt, sources = await searched(ctx.hosted, body.web_search_options, prompt, user, ctx.db, ctx.blobs,
                                         ctx.settings)
    fmt = _ChatFormat(ask.reasoning_effort is not None, ask.logprobs is not None, sources)
    return await _respond(ctx, body, [(ask, prompt, body.user_text(prompt))], fmt, session)


@router.post("/completions", responses=openai_stream("text_completion", CompletionOut) | OPENAI_ANSWER)
async def completions(body: CompletionIn, ctx: Ctx, user: CurrentUser, session: SessionDep):
    """A plain-text continuation of `prompt` (text, or token ids), without the chat template; a list of
    prompts gets n choices each."""
    return await completion_answer(ctx, body, user, session)


async def completion_answer(ctx: AppContext, body: CompletionIn, user: User, session: AsyncSession,
                            batch: bool = False):
    """The completion route's answer; `batch`: run in the batch class (the Batch API's lines)."""
    prompts = body.to_prompts()
    ask = replace(body.to_ask(user, f"cmpl-{uuid.uuid4().hex}"), batch=batch)
    texts = [prompt_text(p, lambda ids: _decode(ctx, ids)) for p in prompts]
    parts = [(ask if i == 0 else replace(ask, request_id=f"{ask.request_id}-{i}"), p, t)
             for i, (p, t) in enumerate(zip(prompts, texts))]
    fmt = _CompletionFormat(ask.logprobs is not None, texts if body.echo else None, ask.n)
    return await _respond(ctx, body, parts, fmt, session)


def _decode(ctx: AppContext, ids: list[int]) -> str:
    """Token ids as text, for input moderation; ids the tokenizer cannot read are refused by the backend."""
    tokenizer = ctx.backend.tokenizer
    try:
        return tokenizer.decode(ids) if tokenizer is not None else ""
    except Exception:  # out-of-vocabulary ids: the engine answers them with a clear 400
        return ""


def _model(request: Request, ctx: AppContext, model_id: str) -> ModelOut:
    """A served model and what it supports. Every model the backend serves takes chat and plain-text
    prompts (a model without a chat template of its own gets the fallback template) and tool calls (rendered
    into the prompt, forced by a grammar); embeddings are there when the API serves them; vision when the
    model reads images (Idefics3 / SmolVLM served in this process)."""
    paths = {getattr(route, "path", None) for route in request.app.routes}
    return ModelOut(id=model_id, capabilities=CapabilitiesOut(
        chat=True, completions=True, embeddings="/v1/embeddings" in paths, tools=True,
        vision=ctx.backend.takes_images(model_id)))


def _speech_model(ctx: AppContext) -> ModelOut | None:
    """The speech-to-text model of [speech] model, listed beside the chat models: it takes audio only."""
    if ctx.speech is None:
        return None
    return ModelOut(id=ctx.speech.model_id, capabilities=CapabilitiesOut(
        chat=False, completions=False, embeddings=False, tools=False, vision=False, audio=True))


@router.get("/models", response_model=ModelList, responses=SIGNED_IN)
async def list_models(request: Request, ctx: Ctx, user: CurrentUser) -> ModelList:
    """The served models, each with a `capabilities` extension field (the speech model, if any, last)."""
    speech = _speech_model(ctx)
    return ModelList(data=[_model(request, ctx, m) for m in ctx.backend.model_ids] + ([speech] if speech else []))


@router.get("/models/{model_id:path}", response_model=ModelOut, responses=errors(401, 404))
async def get_model(model_id: str, request: Request, ctx: Ctx, user: CurrentUser) -> ModelOut:
    speech = _speech_model(ctx)
    if speech is not None and model_id == speech.id and model_id not in ctx.backend.model_ids:
        return speech
    if model_id not in ctx.backend.model_ids:
        raise ApiError(404, f"the model {model_id!r} does not exist", "model_not_found", "model")
    return _model(request, ctx, model_id)
