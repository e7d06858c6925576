"""A replica's own HTTP face: the engine alone behind an OpenAI-compatible API (`chatloom replica`).

Why a separate, small server rather than the full product: a replica is a model server in a fleet.
It knows nothing of users, quotas or conversations; it takes token ids or text, streams tokens, and
tells routers what they need to place work well: its load under vLLM's metric names (/metrics), and
its prefix cache as a numbered event feed (/v1/kv_events) that a router follows and, after a
reconnect, catches up on. It speaks vLLM's dialect (token-id prompts, top_k, min_tokens, ignore_eos,
stop_token_ids, return_token_ids, /tokenize) so one router and one client work for both.

A client that disconnects aborts its request at once: Starlette cancels the streaming generator,
and the engine stream's cleanup aborts the sequence, freeing its KV blocks at the next step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from chatloom.engine.async_engine import EngineDeadError
from chatloom.engine.kv_holds import POLICIES as KV_POLICIES
from chatloom.engine.sampling_params import InvalidRequest, SamplingParams
from chatloom.serving.backend import BackendNotReady, BadGenerationRequest
from chatloom.serving.local import LocalBackend
from chatloom.serving.openai_protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, _number, embedding_inputs, error_body,
                                              sampling_from_body, sse)

log = logging.getLogger(__name__)
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
MAX_FEED_WAIT_S = 30.0


class _Rejected(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type_, self.code, self.param = status, type_, code, param


class _ReplicaMetrics:
    """vLLM's gauges and counters from the engine's stats, read at scrape time."""

    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished = 0

    def collect(self):
        if not self.backend.ready:
            return
        s = self.backend.stats()
        model = [self.backend.default_model]

        def family(kind, name: str, doc: str, value: float):
            m = kind(name, doc, labels=["model_name"])
            m.add_metric(model, value)
            return m

        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in model execution batches.",
                     s.num_requests_running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be processed.",
                     s.num_requests_waiting)
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                     s.kv_cache_usage_perc)
        # vLLM before 0.10 called it gpu_cache_usage_perc; routers written for either find it.
        yield family(GaugeMetricFamily, "vllm:gpu_cache_usage_perc", "KV-cache usage (older vLLM name).",
                     s.kv_cache_usage_perc)
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.",
                     s.prefix_cache_queries)
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.",
                     s.prefix_cache_hits)
        yield family(CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemptions.",
                     s.num_preemptions)
        yield family(CounterMetricFamily, "vllm:prompt_tokens", "Prefill tokens processed.", self.prompt_tokens)
        yield family(CounterMetricFamily, "vllm:generation_tokens", "Generation tokens processed.",
                     self.generation_tokens)
        yield family(CounterMetricFamily, "vllm:request_success", "Requests finished.", self.requests_finished)


def create_replica_app(backend: LocalBackend) -> FastAPI:
    """The replica's ASGI app around `backend` (loaded at startup if it is not yet)."""
    state = {"draining": False}
    ids = itertools.count()
    metrics = _ReplicaMetrics(backend)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)  # type: ignore[arg-type]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await backend.start()
        except BackendNotReady as exc:
            log.error("%s", exc)  # /health says so; the process stays up to tell callers why
        yield
        await backend.close()

    app = FastAPI(title="chatloom replica", lifespan=lifespan)

    @app.exception_handler(_Rejected)
    async def _rejected(request: Request, exc: _Rejected) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.type_, exc.code, exc.param), status_code=exc.status)

    @app.exception_handler(BadGenerationRequest)
    async def _bad(request: Request, exc: BadGenerationRequest) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "invalid_request_error", exc.code, exc.param), status_code=400)

    def model_card() -> dict:
        return {"id": backend.default_model, "object": "model", "created": 0, "owned_by": "chatloom",
                "root": backend.default_model, "max_model_len": backend.context_window}

    def engine():
        if state["draining"]:
            raise _Rejected(503, "this replica is draining and takes no new requests", "service_unavailable",
                            "draining")
        try:
            return backend.engine
        except BackendNotReady as exc:
            raise _Rejected(503, str(exc), "service_unavailable", "model_not_ready") from None

    async def json_body(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise _Rejected(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _Rejected(400, "the request body must be a JSON object")
        model = body.get("model")
        if model not in (None, "", backend.default_model):
            raise _Rejected(404, f"this replica serves {backend.default_model!r}, not {model!r}",
                            "invalid_request_error", "model_not_found", "model")
        return body

    # -- plain endpoints -------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        if state["draining"]:
            return JSONResponse({"status": "draining", "model": backend.default_model}, status_code=503)
        if not backend.ready:
            status = "failed" if backend.load_error else "loading"
            return JSONResponse({"status": status, "error": backend.load_error}, status_code=503)
        return JSONResponse({"status": "ok", "model": backend.default_model})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(registry), media_type=PROMETHEUS_TEXT)

    @app.post("/drain")
    async def drain() -> dict:
        """Stop taking new requests; running answers finish. /health turns 503 'draining'."""
        state["draining"] = True
        s = backend.stats()
        return {"status": "draining", "running": s.num_requests_running or 0,
                "waiting": s.num_requests_waiting or 0}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        """Forget cached blocks no request holds (vLLM has the same endpoint; benchmarks start cold)."""
        engine().reset_prefix_cache()
        return {"status": "ok"}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await json_body(request)
        engine()
        if isinstance(body.get("messages"), list):
            tokens = backend.encode_messages(body["messages"])
        elif isinstance(body.get("prompt"), str):
            tokens = backend.tokenizer.encode(body["prompt"], add_special=bool(body.get("add_special_tokens", True)))
        else:
            raise _Rejected(400, "give 'prompt' (a string) or 'messages' (a list)", param="prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": backend.context_window}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await json_body(request)
        engine()
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise _Rejected(400, "tokens must be a list of integers", param="tokens")
        return {"prompt": backend.tokenizer.decode(tokens)}

    @app.get("/v1/kv_events")
    async def kv_events(after: int = 0, timeout: float = 0.0) -> dict:
        """The prefix cache's stored/evicted block keys after sequence number `after`. Waits up to
        `timeout` seconds for one (long poll). `reset: true` carries a snapshot of every key instead."""
        log_ = engine().engine.kv_events
        if timeout > 0 and log_.last_seq <= after:
            await asyncio.to_thread(log_.wait, after, min(timeout, MAX_FEED_WAIT_S))
        batch = log_.since(after)
        return {"model_key": log_.model_key, "block_size": log_.block_size, "last_seq": batch.last_seq,
                "reset": batch.reset, "snapshot": list(batch.snapshot),
                "events": [{"seq": e.seq, "type": e.kind, "keys": list(e.keys)} for e in batch.events]}

    # -- generation ----------------------------------------------------------------------
    def prompt_ids(body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = backend.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids = list(prompt)
        else:
            raise _Rejected(400, "prompt must be a non-empty string or a list of token ids (one prompt only)",
                            param="prompt")
        return ids

    async def run(ids: list[int], params: SamplingParams, request_id: str, priority: int) -> AsyncIterator:
        """Engine outputs, with the request's own problems (too long, bad ids) raised before streaming."""
        eng = engine()
        window = backend.context_window
        if len(ids) >= window:
            raise _Rejected(400, f"the prompt has {len(ids)} tokens; this model's context window is "
                                 f"{window} tokens and the answer needs room too", code="context_length_exceeded",
                            param="prompt")
        stream = eng.stream(ids, params, request_id=request_id, priority=priority)
        try:
            first = await stream.__anext__()
        except InvalidRequest as exc:
            raise _Rejected(400, str(exc)) from None
        except EngineDeadError as exc:
            raise _Rejected(500, str(exc), "server_error") from None
        metrics.prompt_tokens += len(ids)
        return first, stream

    async def outputs(first, stream) -> AsyncIterator:
        out = first
        try:
            while True:
                yield out
                if out.finished:
                    metrics.generation_tokens += out.num_output_tokens
                    metrics.requests_finished += 1
                    return
                out = await stream.__anext__()
        finally:
            await stream.aclose()

    def usage(out) -> dict:
        return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
                "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    async def generate(body: dict, ids: list[int], params: SamplingParams, chat: bool):
        # A round whose KV cache is kept is named by its handle, which hold and resume refer to.
        request_id = body["kv_handle"] if params.keep_kv else \
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}-{next(ids_counter)}"
        # vLLM's field: lower runs first; at the engine's background_priority or above, batch work.
        priority = _number(body, "priority", int, 0)
        first, stream = await run(ids, params, request_id, priority)
        created = int(time.time())
        model = backend.default_model
        with_ids = bool(body.get("return_token_ids"))
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str, token_ids: list[int], finish: str | None) -> dict:
            c: dict = {"index": 0, "finish_reason": finish}
            if chat:
                c["delta" if body.get("stream") else "message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            if with_ids:
                c["token_ids"] = token_ids
            return c

        if not body.get("stream"):
            text, tokens, last = [], [], None
            async for out in outputs(first, stream):
                text.append(out.delta_text)
                last = out
            tokens = last.token_ids
            result = {"id": request_id, "object": obj, "created": created, "model": model,
                      "choices": [choice("".join(text), tokens, last.finish_reason)], "usage": usage(last)}
            if with_ids:
                result["prompt_token_ids"] = ids
            return JSONResponse(result)

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def events() -> AsyncIterator[str]:
            sent = 0  # output token ids already sent
            head = {"id": request_id, "object": chunk_obj, "created": created, "model": model}
            if with_ids:
                yield sse({**head, "choices": [], "prompt_token_ids": ids})
            async for out in outputs(first, stream):
                new_ids = out.token_ids[sent:] if out.finished else out.delta_token_ids
                sent += len(new_ids)
                if out.delta_text or new_ids or out.finished:
                    yield sse({**head, "choices": [choice(out.delta_text, new_ids,
                                                          out.finish_reason if out.finished else None)]})
                if out.finished and include_usage:
                    yield sse({**head, "choices": [], "usage": usage(out)})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    ids_counter = ids

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        engine()
        params = sampling_from_body(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
        return await generate(body, prompt_ids(body), params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        engine()
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content", ""), str) for m in messages):
            raise _Rejected(400, "messages must be a non-empty list of {role, content} objects", param="messages")
        ids = backend.encode_messages(messages)
        params = sampling_from_body(body, max(1, backend.context_window - len(ids)))
        return await generate(body, ids, params, chat=True)

    @app.post("/kv/hold")
    async def kv_hold(request: Request) -> dict:
        """The kept round `handle` ended in calls to `tools`: hold or evict its KV cache (engine/kv_holds.py)."""
        body = await json_body(request)
        handle, tools, policy = body.get("handle"), body.get("tools") or [], body.get("policy")
        if not isinstance(handle, str) or not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
            raise _Rejected(400, "handle must be a string and tools a list of strings", param="handle")
        if policy not in KV_POLICIES:
            raise _Rejected(400, f"policy must be one of {', '.join(KV_POLICIES)}", param="policy")
        backend.hold_kv(handle, tools, policy, _number(body, "timeout_s", float, 60.0))
        return {"handle": handle}

    @app.post("/kv/release")
    async def kv_release(request: Request) -> dict:
        body = await json_body(request)
        if not isinstance(body.get("handle"), str):
            raise _Rejected(400, "handle must be a string", param="handle")
        backend.release_kv(body["handle"])
        return {"handle": body["handle"]}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        body = await json_body(request)
        engine()
        if body.get("encoding_format", "float") != "float":
            raise _Rejected(400, "this replica answers encoding_format float only", param="encoding_format")
        result = await backend.embed(embedding_inputs(body.get("input")))
        metrics.prompt_tokens += result.prompt_tokens
        return {"object": "list", "model": backend.default_model,
                "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(result.vectors)],
                "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}}

    return app
