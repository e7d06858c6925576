"""The Anthropic Messages API: POST /v1/messages (streamed or not) and /v1/messages/count_tokens.

A format adapter over the shared generation pipeline, as the OpenAI routes are: the request becomes an
`Ask` and a prompt, the pipeline's pieces become Anthropic's content blocks or its stream events.
Stateless, and tied to the connection (a client that goes away aborts the generation). Errors come in
Anthropic's shape (core/errors.py), with 529 overloaded_error when the admission queue refuses; a stream
that must end early after it began says so with an `error` event.
"""
from __future__ import annotations

import uuid

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from chatloom.app.api.anthropic_out import AnthropicMessageOut, CountTokensOut
from chatloom.app.api.anthropic_schemas import CountTokensIn, MessagesIn
from chatloom.app.api.deps import Ctx, CurrentUser, SessionDep
from chatloom.app.api.openapi_responses import ANTHROPIC_ANSWER, ANTHROPIC_ERROR_SCHEMA, anthropic_stream, errors
from chatloom.app.api.run_start import start_run
from chatloom.app.api.sse import SSE_HEADERS, EventStreamResponse, frame
from chatloom.app.core.image_input import ImageReader, reading_images, require_vision
from chatloom.app.core.errors import ApiError, anthropic_error_body, anthropic_status
from chatloom.app.core.validation import off_loop
from chatloom.app.generation.pipeline import AnswerText, Run, ToolCall
from chatloom.serving import BackendError, BadGenerationRequest

router = APIRouter(prefix="/v1", tags=["anthropic"])


def stop_reason(run: Run) -> str:
    """The pipeline's finish reason in Anthropic's words."""
    reason = run.finish_reason
    if reason == "tool_calls":
        return "tool_use"
    if reason == "content_filter":  # the output guard stopped the answer
        return "refusal"
    if reason == "length":
        # Cut by the context window before the budget the request allowed was spent.
        return "model_context_window_exceeded" if run.max_tokens < run.limits.max_tokens else "max_tokens"
    return "stop_sequence" if run.stop_sequence is not None else "end_turn"


def usage(run: Run) -> dict:
    """Anthropic counts prompt tokens read from a cache apart from input_tokens."""
    u = run.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.parsed_arguments}


def _event(data: dict) -> bytes:
    return frame(data, event=data["type"])


def error_event(exc: Exception) -> bytes:
    """A failure after the stream began, as Anthropic's `error` event."""
    if isinstance(exc, ApiError):
        return _event(anthropic_error_body(anthropic_status(exc.status, exc.code), exc.message))
    if isinstance(exc, BadGenerationRequest):
        return _event(anthropic_error_body(400, str(exc)))
    return _event(anthropic_error_body(500, f"generation failed: {exc}"))


class _StreamFormat:
    """Anthropic's stream events for one answer: text runs become text blocks, each tool call a tool_use
    block whose input arrives as one input_json_delta; blocks are numbered in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the type of the block being written

    def _start(self, block: dict) -> list[bytes]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        events.append(_event({"type": "content_block_start", "index": self.index, "content_block": block}))
        return events

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event({"type": "content_block_stop", "index": self.index})]

    def text(self, text: str) -> list[bytes]:
        events = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        events.append(_event({"type": "content_block_delta", "index": self.index,
                              "delta": {"type": "text_delta", "text": text}}))
        return events

    def tool_call(self, call: ToolCall) -> list[bytes]:
        events = self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        events.append(_event({"type": "content_block_delta", "index": self.index,
                              "delta": {"type": "input_json_delta", "partial_json": call.arguments}}))
        events += self.close()
        return events


@router.post("/messages", responses=anthropic_stream(AnthropicMessageOut) | ANTHROPIC_ANSWER)
async def create_message(body: MessagesIn, ctx: Ctx, user: CurrentUser, session: SessionDep):
    tools = body.tool_use()
    if body.has_images():  # a model that takes none is named before any image is read
        require_vision(ctx.backend, body.model)
    reader = ImageReader(ctx.settings.vision, "messages")
    if body.has_images():
        await reader.fetch(body.image_urls())
    prompt = await reading_images(body.has_images(), body.prompt, tools, reader)
    ask = body.to_ask(user, f"msg_{uuid.uuid4().hex}", tools)
    run, pieces, first = await start_run(ctx.pipeline, ask, prompt, body.user_text(prompt), session)
    message = {"id": run.request_id, "type": "message", "role": "assistant", "model": run.limits.model}

    if not body.stream:
        content: list[dict] = []
        try:
            piece = first
            while piece is not None:
                if isinstance(piece, AnswerText):
                    if content and content[-1]["type"] == "text":
                        content[-1]["text"] += piece.text
                    else:
                        content.append({"type": "text", "text": piece.text})
                elif isinstance(piece, ToolCall):
                    content.append(tool_use_block(piece))
                piece = await anext(pieces, None)
        finally:
            await pieces.aclose()
            await run.close()
        return JSONResponse({**message, "content": content, "stop_reason": stop_reason(run),
                             "stop_sequence": run.stop_sequence, "usage": usage(run)})

    async def events():
        fmt = _StreamFormat()
        ended = False  # the answer went out whole: the run is closed after the response (see below)
        try:
            yield _event({"type": "message_start", "message": {
                **message, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": run.counted_prompt_tokens or 0, "output_tokens": 0}}})
            yield _event({"type": "ping"})
            piece = first
            while piece is not None:
                if isinstance(piece, AnswerText):
                    for event in fmt.text(piece.text):
                        yield event
                elif isinstance(piece, ToolCall):
                    for event in fmt.tool_call(piece):
                        yield event
                piece = await anext(pieces, None)
            for event in fmt.close():
                yield event
            await run.release()  # the user's next request may start as soon as this one's stream ends
            yield _event({"type": "message_delta",
                          "delta": {"stop_reason": stop_reason(run), "stop_sequence": run.stop_sequence},
                          "usage": usage(run)})
            yield _event({"type": "message_stop"})
            ended = True
        except (ApiError, BadGenerationRequest, BackendError) as exc:
            yield error_event(exc)
        finally:
            await pieces.aclose()  # a client that left aborts the request
            if not ended:
                await run.close()

    # Metering (a database write) runs once the response is complete, as on the OpenAI routes.
    return EventStreamResponse(events(), headers=SSE_HEADERS, background=BackgroundTask(run.close))


@router.post("/messages/count_tokens", response_model=CountTokensOut,
             responses=errors(400, 401, 403, 404, 413, schema=ANTHROPIC_ERROR_SCHEMA))
async def count_tokens(body: CountTokensIn, ctx: Ctx, user: CurrentUser) -> CountTokensOut:
    """The prompt's tokens as /v1/messages would send it (system, turns, tools), without running it."""
    tools = body.tool_use()
    if body.has_images():
        require_vision(ctx.backend, body.model)
    reader = ImageReader(ctx.settings.vision, "messages")
    if body.has_images():
        await reader.fetch(body.image_urls())
    prompt = await reading_images(body.has_images(), body.prompt, tools, reader)
    backend = ctx.backend
    model = backend.resolve_model(body.model)  # an unknown model is a 404, as on /v1/messages
    ctx.traffic.check_model(ctx.traffic.tier(user), model)
    size = sum(len(m["content"]) for m in prompt.messages)
    tokens = await off_loop(backend.count_prompt_tokens, prompt.messages, size=size)
    return CountTokensOut(input_tokens=tokens)
