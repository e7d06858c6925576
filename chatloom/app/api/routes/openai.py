"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions (streamed or not) and /v1/models.

A format adapter over the shared generation pipeline: the request becomes an `Ask` and a prompt,
the pipeline's pieces become OpenAI's chunks or its whole response. Stateless: nothing is stored,
and the generation is tied to the connection (a client that goes away aborts it). Errors use
OpenAI's shape so the official SDKs raise their usual exceptions.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.background import BackgroundTask

from chatloom.app.api.deps import AppContext, Ctx, CurrentUser, SessionDep
from chatloom.app.core.errors import ApiError, error_body
from chatloom.app.core.image_input import ImageReader, reading_images, require_vision
from chatloom.app.api.openai_out import CapabilitiesOut, ChatCompletionOut, CompletionOut, ModelList, ModelOut
from chatloom.app.api.openai_schemas import ChatCompletionIn, CompletionIn, SamplingIn, prompt_text
from chatloom.app.api.openapi_responses import OPENAI_ANSWER, SIGNED_IN, errors, openai_stream
from chatloom.app.generation.pipeline import AnswerText, Ask, Finished, Piece, Prompt, Thinking, ToolCall
from chatloom.app.api.run_start import start_run
from chatloom.app.api.sse import SSE_HEADERS, EventStreamResponse, frame
from chatloom.serving import BackendError, BadGenerationRequest, Usage

router = APIRouter(prefix="/v1", tags=["openai"])


def _usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("length", "content_filter", "tool_calls") else "stop"


def _call_out(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class _ChatFormat:
    """chat.completion(.chunk) objects; the thinking goes in reasoning_content, as vLLM sends it.
    A tool call streams as OpenAI's deltas: one with its index, id and name, then its arguments."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, reasoning: bool) -> None:
        self.reasoning = reasoning
        self.calls_sent = 0

    def tool_call_chunks(self, call: ToolCall) -> list[dict]:
        index = self.calls_sent
        self.calls_sent += 1
        head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        return [{"delta": {"tool_calls": [head]}},
                {"delta": {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}}]

    def opening(self) -> dict | None:
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

    def closing(self, reason: str) -> dict:
        return {"delta": {}, "finish_reason": reason}

    def whole(self, answer: str, thinking: str, reason: str, calls: list[ToolCall]) -> dict:
        message = {"role": "assistant", "content": answer or (None if calls else ""), "refusal": None}
        if calls:
            message["tool_calls"] = [_call_out(c) for c in calls]
        if self.reasoning:
            message["reasoning_content"] = thinking
        return {"message": message, "finish_reason": reason}


class _CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"

    def opening(self) -> dict | None:
        return None

    def text_field(self, piece: Piece) -> str | None:
        return "text" if isinstance(piece, AnswerText) else None

    def text_choice(self, field: str, text: str) -> dict:
        return {field: text}

    def closing(self, reason: str) -> dict:
        return {"text": "", "finish_reason": reason}

    def tool_call_chunks(self, call: ToolCall) -> list[dict]:
        return []

    def whole(self, answer: str, thinking: str, reason: str, calls: list[ToolCall]) -> dict:
        return {"text": answer, "finish_reason": reason}


_MARK = "\u0000chatloom-text\u0000"
_MARK_JSON = json.dumps(_MARK).encode()


class _TextChunks:
    """The SSE bytes of a stream's text chunks. Consecutive chunks differ only in their text, so the
    JSON around it is encoded once per field and each token costs one json.dumps of its own text
    (the bytes are the same as `chunk(...)` would give: a JSON string never holds a raw newline)."""

    def __init__(self, chunk: Callable[[dict], bytes], fmt) -> None:
        self._chunk = chunk
        self._fmt = fmt
        self._frames: dict[str, tuple[bytes, bytes]] = {}

    def __call__(self, field: str, text: str) -> bytes:
        parts = self._frames.get(field)
        if parts is None:
            head, tail = self._chunk(self._fmt.text_choice(field, _MARK)).split(_MARK_JSON)
            parts = self._frames[field] = (head, tail)
        return parts[0] + json.dumps(text, ensure_ascii=False).encode() + parts[1]


async def _respond(ctx: AppContext, body: SamplingIn, ask: Ask, prompt: Prompt, moderate: str, fmt,
                   session: AsyncSession):
    run, pieces, first = await start_run(ctx.pipeline, ask, prompt, moderate, session)
    base = {"id": run.request_id, "object": fmt.object, "created": int(time.time()), "model": run.limits.model,
            "system_fingerprint": None}

    if not body.stream:
        answer, thinking, calls = [], [], []
        try:
            piece = first
            while piece is not None:
                if isinstance(piece, AnswerText):
                    answer.append(piece.text)
                elif isinstance(piece, Thinking):
                    thinking.append(piece.text)
                elif isinstance(piece, ToolCall):
                    calls.append(piece)
                piece = await anext(pieces, None)
        finally:
            await pieces.aclose()
            await run.close()
        choice = fmt.whole("".join(answer), "".join(thinking), _finish_reason(run.finish_reason), calls)
        return JSONResponse({**base, "choices": [{"index": 0, "logprobs": None, **choice}], "usage": _usage(run.usage)})

    include_usage = body.include_usage

    def chunk(choice: dict) -> bytes:
        data = {**base, "object": fmt.chunk_object,
                "choices": [{"index": 0, "logprobs": None, "finish_reason": None, **choice}]}
        if include_usage:
            data["usage"] = None
        return frame(data)

    text_chunk = _TextChunks(chunk, fmt)

    async def events():
        ended = False  # the answer went out whole: the run is closed after the response (see below)
        try:
            opening = fmt.opening()
            if opening is not None:
                yield chunk(opening)
            piece = first
            while piece is not None:
                if isinstance(piece, Finished):
                    yield chunk(fmt.closing(_finish_reason(run.finish_reason)))
                elif isinstance(piece, ToolCall):
                    for choice in fmt.tool_call_chunks(piece):
                        yield chunk(choice)
                elif (field := fmt.text_field(piece)) is not None:
                    yield text_chunk(field, piece.text)
                piece = await anext(pieces, None)
            await run.release()  # the user's next request may start as soon as this one's stream ends
            if include_usage:
                yield frame({**base, "object": fmt.chunk_object, "choices": [], "usage": _usage(run.usage)})
            ended = True
        except (BadGenerationRequest, BackendError) as exc:
            yield frame(error_body(500, f"generation failed: {exc}", "generation_failed"))
        finally:
            await pieces.aclose()  # a client that left aborts the request
            if not ended:
                await run.close()
        yield frame("[DONE]")

    # Closing a run meters its usage in the database (a commit: 3-6 ms measured on SQLite), which the
    # client would otherwise wait for before its stream ends; it runs once the response is complete.
    # (Run.close is idempotent: where the stream was cut short, the generator has closed the run already.)
    return EventStreamResponse(events(), headers=SSE_HEADERS, background=BackgroundTask(run.close))


@router.post("/chat/completions", responses=openai_stream("chat.completion.chunk", ChatCompletionOut) | OPENAI_ANSWER)
async def chat_completions(body: ChatCompletionIn, ctx: Ctx, user: CurrentUser, session: SessionDep):
    tools = body.tool_use()
    if body.has_images():  # a model that takes none is named before any image is read
        require_vision(ctx.backend, body.model)
    prompt = await reading_images(body.has_images(), body.prompt, tools, ImageReader(ctx.settings.vision, "messages"))
    ask = body.to_ask(user, f"chatcmpl-{uuid.uuid4().hex}", tools)
    return await _respond(ctx, body, ask, prompt, body.user_text(prompt), _ChatFormat(ask.reasoning_effort is not None),
                          session)


@router.post("/completions", responses=openai_stream("text_completion", CompletionOut) | OPENAI_ANSWER)
async def completions(body: CompletionIn, ctx: Ctx, user: CurrentUser, session: SessionDep):
    """A plain-text continuation of `prompt` (text, or token ids), without the chat template."""
    prompt = body.to_prompt()
    ask = body.to_ask(user, f"cmpl-{uuid.uuid4().hex}")
    text = prompt_text(prompt, lambda ids: _decode(ctx, ids))
    return await _respond(ctx, body, ask, prompt, text, _CompletionFormat(), session)


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


@router.get("/models", response_model=ModelList, responses=SIGNED_IN)
async def list_models(request: Request, ctx: Ctx, user: CurrentUser) -> ModelList:
    """The served models, each with a `capabilities` extension field."""
    return ModelList(data=[_model(request, ctx, m) for m in ctx.backend.model_ids])


@router.get("/models/{model_id:path}", response_model=ModelOut, responses=errors(401, 404))
async def get_model(model_id: str, request: Request, ctx: Ctx, user: CurrentUser) -> ModelOut:
    if model_id not in ctx.backend.model_ids:
        raise ApiError(404, f"the model {model_id!r} does not exist", "model_not_found", "model")
    return _model(request, ctx, model_id)
