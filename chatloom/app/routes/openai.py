"""The OpenAI-compatible API: /v1/chat/completions (streamed or not) and /v1/models.

Stateless: nothing is stored, and the generation is tied to the connection (a client that
goes away aborts it). Errors use OpenAI's shape so the official SDKs raise their usual exceptions.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app import reasoning
from chatloom.app.admission import INTERACTIVE, REASONING
from chatloom.app.auth import current_user
from chatloom.app.deps import get_context, get_session
from chatloom.app.errors import ApiError, error_body
from chatloom.app.sse import SSE_HEADERS, frame
from chatloom.serving import Backend, BackendError, BadGenerationRequest, Delta, GenerationRequest
from chatloom.store import User

router = APIRouter(prefix="/v1", tags=["openai"])

CREATED = int(time.time())


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content parts of type {part.type!r} are not supported; send text",
                               "unsupported_content", "messages")
            texts.append(part.text)
        return "".join(texts)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionIn(BaseModel):
    # Unknown OpenAI parameters (presence_penalty, logit_bias...) are accepted and ignored, as other
    # compatible servers do, so existing clients keep working.
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=256)
    # OpenAI's parameter for reasoning models: the thinking streams as delta.reasoning_content (as vLLM does).
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops


def _usage(last: Delta) -> dict:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("length", "content_filter") else "stop"


def _to_request(body: ChatCompletionIn, backend: Backend, default_max_tokens: int) -> GenerationRequest:
    if body.n not in (None, 1):
        raise ApiError(400, "only n=1 is supported", "unsupported_value", "n")
    model = backend.resolve_model(body.model)
    messages = []
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role
        if role == "tool":
            raise ApiError(400, "tool messages are not supported", "unsupported_value", "messages")
        messages.append({"role": role, "content": m.text()})
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    return GenerationRequest(messages=messages, model=model, max_tokens=max_tokens,
                             temperature=1.0 if body.temperature is None else body.temperature,
                             top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                             stop=body.stop or [], request_id=f"chatcmpl-{uuid.uuid4().hex}")


class _Traffic:
    """One request's trip through traffic control: tier caps, input moderation, the quota
    reservation, the admission slot; then thinking split off and the output guarded while it streams,
    and at the end the quota settled, the usage metered, the latencies observed."""

    def __init__(self, request: Request, user: User, body: ChatCompletionIn, req: GenerationRequest) -> None:
        ctx = get_context(request)
        self.traffic, self.backend, self.user, self.req = ctx.traffic, ctx.backend, user, req
        self.tier = self.traffic.tier(user)
        self.traffic.check_model(self.tier, req.model)
        req.max_tokens = self.traffic.cap_max_tokens(self.tier, req.max_tokens)
        self.traffic.check_input("\n".join(m["content"] for m in req.messages if m["role"] != "assistant"),
                                 "messages")
        self.effort = self.traffic.effort(body.reasoning_effort)
        if self.effort is not None:
            req.messages = reasoning.with_instructions(req.messages, self.effort)
            req.max_tokens += reasoning.BUDGET_TOKENS[self.effort]
        req.priority = -self.tier.priority  # the engine runs low numbers first
        self.prompt_tokens = self.backend.count_prompt_tokens(req.messages)
        self.reservation = None  # reserved by admit(): the quota store may be another server
        self.slot = None
        self.guard = self.traffic.output_guard()
        self.splitter = reasoning.ThinkingSplitter() if self.effort else None
        self.last = Delta("")
        self.finish_reason: str | None = None
        self._closed = False

    async def admit(self) -> None:
        self.reservation = await self.traffic.reserve(self.user, self.tier, self.prompt_tokens + self.req.max_tokens)
        try:
            self.slot = await self.traffic.admit(self.tier, self.prompt_tokens,
                                                 REASONING if self.effort else INTERACTIVE)
        except BaseException:
            await self.close()
            raise

    async def pieces(self, stream):
        """(kind, text) pieces to show, kind 'content' or 'reasoning'; aborts the request on a violation."""
        async for delta in stream:
            self.slot.started()
            self.last = delta
            if self.guard.verdict is not None:
                continue
            parts = self.splitter.push(delta.text) if self.splitter else [("answer", delta.text)]
            if delta.finished:
                parts += self.splitter.finish() if self.splitter else []
            for kind, text in parts:
                if kind == "thinking":
                    yield "reasoning", text
                else:
                    for shown in self.guard.push(text):
                        yield "content", shown
            if delta.finished and self.guard.verdict is None:
                for shown in self.guard.finish():
                    yield "content", shown
            if self.guard.verdict is not None:
                self.traffic.output_blocked(self.guard)
                if not delta.finished:
                    self.backend.abort(self.req.request_id)
        self.finish_reason = "content_filter" if self.guard.verdict else self.last.finish_reason

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.slot is not None:
            self.slot.release()
        last = self.last
        used = last.prompt_tokens + last.completion_tokens
        if self.reservation is not None:
            await self.traffic.quotas.settle(self.reservation, used)
        if used:
            await self.traffic.meter.record(self.user.id, self.req.model, last.prompt_tokens, last.completion_tokens,
                                            last.cached_tokens)
            self.traffic.metrics.observe_request(last.metrics, self.finish_reason or last.finish_reason,
                                                 last.prompt_tokens, last.completion_tokens)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionIn, request: Request, user: User = Depends(current_user),
                           session: AsyncSession = Depends(get_session)):
    ctx = get_context(request)
    backend = ctx.backend
    req = _to_request(body, backend, ctx.settings.default_max_tokens)
    control = _Traffic(request, user, body, req)
    # Authentication is done with the database: hand its connection back before a possibly long
    # wait in the queue, or a burst of waiting requests would drain the connection pool.
    await session.close()
    # Queue for room before answering, so a request that waits too long is a real 503.
    await control.admit()
    chunk_base = {"id": req.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                  "model": req.model, "system_fingerprint": None}
    stream = backend.stream(req)
    pieces = control.pieces(stream)
    # Wait for the first piece before answering, so a refused request (prompt too long, model not
    # ready) is a proper HTTP error rather than an error inside a 200 stream.
    try:
        first = await pieces.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()
        await control.close()
        raise

    if not body.stream:
        content, thinking = [], []
        try:
            if first is not None:
                (content if first[0] == "content" else thinking).append(first[1])
                async for kind, text in pieces:
                    (content if kind == "content" else thinking).append(text)
        finally:
            await stream.aclose()
            await control.close()
        message = {"role": "assistant", "content": "".join(content), "refusal": None}
        if control.effort is not None:
            message["reasoning_content"] = "".join(thinking)
        return JSONResponse({
            "id": req.request_id, "object": "chat.completion", "created": chunk_base["created"], "model": req.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish_reason(control.finish_reason)}],
            "usage": _usage(control.last)})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        data = {**chunk_base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": finish_reason}]}
        if include_usage:
            data["usage"] = None
        return frame(data)

    def piece_chunk(kind: str, text: str) -> bytes:
        return chunk({"reasoning_content" if kind == "reasoning" else "content": text})

    async def events():
        try:
            yield chunk({"role": "assistant", "content": ""})
            if first is not None:
                yield piece_chunk(*first)
                async for kind, text in pieces:
                    yield piece_chunk(kind, text)
            yield chunk({}, _finish_reason(control.finish_reason))
            if include_usage:
                yield frame({**chunk_base, "choices": [], "usage": _usage(control.last)})
        except (BadGenerationRequest, BackendError) as exc:
            yield frame(error_body(500, f"generation failed: {exc}", "generation_failed"))
        finally:
            await stream.aclose()  # a client that left aborts the request
            await control.close()
        yield frame("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def _model_out(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": CREATED, "owned_by": "chatloom"}


@router.get("/models")
async def list_models(request: Request, user: User = Depends(current_user)) -> dict:
    return {"object": "list", "data": [_model_out(m) for m in get_context(request).backend.model_ids]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request, user: User = Depends(current_user)) -> dict:
    if model_id not in get_context(request).backend.model_ids:
        raise ApiError(404, f"the model {model_id!r} does not exist", "model_not_found", "model")
    return _model_out(model_id)
