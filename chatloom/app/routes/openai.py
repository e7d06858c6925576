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

from chatloom.app.auth import current_user
from chatloom.app.deps import get_context
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
    return "length" if reason == "length" else "stop"


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


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionIn, request: Request, user: User = Depends(current_user)):
    ctx = get_context(request)
    backend = ctx.backend
    req = _to_request(body, backend, ctx.settings.default_max_tokens)
    chunk_base = {"id": req.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                  "model": req.model, "system_fingerprint": None}
    stream = backend.stream(req)
    # Wait for the first delta before answering, so a refused request (prompt too long, model not
    # ready) is a proper HTTP error rather than an error inside a 200 stream.
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = Delta("", True, "stop")

    if not body.stream:
        parts, last = [first.text], first
        try:
            if not first.finished:
                async for delta in stream:
                    parts.append(delta.text)
                    last = delta
        finally:
            await stream.aclose()
        return JSONResponse({
            "id": req.request_id, "object": "chat.completion", "created": chunk_base["created"], "model": req.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts), "refusal": None},
                         "logprobs": None, "finish_reason": _finish_reason(last.finish_reason)}],
            "usage": _usage(last)})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        data = {**chunk_base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": finish_reason}]}
        if include_usage:
            data["usage"] = None
        return frame(data)

    async def events():
        last = first
        try:
            yield chunk({"role": "assistant", "content": ""})
            if first.text:
                yield chunk({"content": first.text})
            if not first.finished:
                async for delta in stream:
                    last = delta
                    if delta.text:
                        yield chunk({"content": delta.text})
            yield chunk({}, _finish_reason(last.finish_reason))
            if include_usage:
                yield frame({**chunk_base, "choices": [], "usage": _usage(last)})
        except (BadGenerationRequest, BackendError) as exc:
            yield frame(error_body(500, f"generation failed: {exc}", "generation_failed"))
        finally:
            await stream.aclose()  # a client that left aborts the request
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
