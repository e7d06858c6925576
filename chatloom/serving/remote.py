"""The Backend interface over one OpenAI-compatible server: a chatloom replica, vLLM or SGLang.

Why token ids on the wire: the router continues an answer whose replica died by sending the prompt
plus the tokens produced so far as a new prompt, so it needs those tokens exactly, not re-tokenized
text. `stream_tokens` sends a token-id prompt to /v1/completions and asks for the output's token ids
(`return_token_ids`, which chatloom replicas and recent vLLM servers honour). The plain `stream`
(the Backend API) uses chat completions when no local tokenizer is at hand.

Errors are mapped to ours: the server's 4xx refusals become BadGenerationRequest (the user's problem,
not the replica's), everything else (refused or reset connections, timeouts, 5xx, answers that are not
OpenAI-shaped JSON) becomes ReplicaError, which the router treats as "try another replica".
Closing the stream closes the HTTP connection, which aborts the request on the server.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import AsyncIterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from chatloom.engine.sampling_params import InvalidRequest, SamplingParams
from chatloom.serving.backend import (Backend, BackendError, BackendNotReady, BackendStats, BadGenerationRequest,
                                      Delta, EmbedInput, Embeddings, GenerationRequest, TextLogprob)
from chatloom.serving.answer_http import AnswerClient, AnswerHTTPError, AnswerStream
from chatloom.serving.openai_protocol import error_message, sampling_to_body

log = logging.getLogger(__name__)


class ReplicaError(BackendError):
    """The server failed (unreachable, timed out, crashed, answered garbage): another may serve it."""


class ReplicaTimeout(ReplicaError):
    """The server did not answer in time: busy or hung. Worth trying elsewhere; health checks decide ejection."""


class ReplicaModelMismatch(ReplicaError):
    """The server is up but does not serve the model it was configured for."""


@dataclass
class TokenChunk:
    """One streamed piece of an answer: its text, its token ids and, on the last, why it ended."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    logprobs: list[TextLogprob] | None = None  # where asked and the server gives them


@dataclass
class ServerInfo:
    """What a probe of /v1/models learned."""

    models: list[str]
    max_model_len: int | None
    # A chatloom replica orders its queue by the request's `priority` and runs batch work only in steps
    # interactive work leaves idle. vLLM takes the same field only when started with priority scheduling
    # (and refuses it otherwise), so it is sent to chatloom replicas alone.
    takes_priority: bool = False


@dataclass
class Timeouts:
    connect: float = 3.0  # probes; a server this slow to accept is as good as down
    probe: float = 5.0  # /health, /v1/models, /metrics
    stream_connect: float = 15.0  # a busy server's event loop may be slow to accept; do not give up early
    between_chunks: float = 60.0  # a stream silent this long is a dead replica


def estimate_tokens(text: str) -> int:
    """A token count without a tokenizer: about 4 bytes a token (quotas settle on the server's count)."""
    return max(1, math.ceil(len(text.encode("utf-8")) / 4))


def count_text_tokens(tokenizer, text: str) -> int:
    """Tokens `text` takes as content: exact with a local tokenizer, else estimated."""
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special=False))
    return estimate_tokens(text)


def count_chat_tokens(tokenizer, messages: list[dict]) -> int:
    """Tokens the rendered chat prompt takes: exact with a local tokenizer, else estimated."""
    if tokenizer is not None:
        return len(encode_chat(tokenizer, messages))
    return sum(estimate_tokens(m.get("content") or "") + 4 for m in messages) + 2


class RemoteBackend(Backend):
    """One OpenAI-compatible server. `model` is the id it must serve (None: whatever it lists first)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 tokenizer=None, timeouts: Timeouts | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"replica URL {base_url!r} must start with http:// or https://")
        self.model = model
        self._tokenizer = tokenizer
        self.timeouts = timeouts or Timeouts()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Made once: each client would otherwise load the CA certificates again (milliseconds of the loop).
        self._ssl = httpx.create_ssl_context()
        self._client = httpx.AsyncClient(  # probes, embeddings, KV instructions
            base_url=self.base_url, headers=headers, verify=self._ssl,
            timeout=httpx.Timeout(self.timeouts.probe, connect=self.timeouts.connect),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        # What every answer sends (its /tokenize, its stream): the gateway's hot path (see answer_http).
        self._answers = AnswerClient(self.base_url, headers, self._ssl, self.timeouts.stream_connect,
                                     self.timeouts.between_chunks)
        self._info: ServerInfo | None = None
        self._error: str | None = None
        self._responses: dict[str, AnswerStream] = {}
        self._background: set = set()  # KV instructions on their way

    def __repr__(self) -> str:
        return f"RemoteBackend({self.base_url!r}, model={self.model!r})"

    def _priority(self, priority: int) -> dict:
        """The request body's priority field, where the server takes one and it is not the default."""
        return {"priority": priority} if priority and self._info is not None and self._info.takes_priority else {}

    # -- probing ----------------------------------------------------------------------
    async def _get_json(self, path: str, **kw) -> dict:
        try:
            r = await self._client.get(path, **kw)
        except httpx.HTTPError as exc:
            raise ReplicaError(f"{self.base_url}{path}: {_describe(exc)}") from None
        return _json_or_error(r.status_code, _body(r), f"{self.base_url}{path}")

    async def probe(self) -> ServerInfo:
        """Ask /v1/models what the server serves; ReplicaError says why it cannot be used."""
        body = await self._get_json("/v1/models")
        data = body.get("data")
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise ReplicaError(f"{self.base_url}/v1/models did not answer as an OpenAI-compatible server "
                               f"(no list of models)")
        models = [m["id"] for m in data]
        if self.model is not None and self.model not in models:
            raise ReplicaModelMismatch(f"{self.base_url} serves {', '.join(models) or 'no model'}, "
                                       f"not {self.model!r}")
        card = next((m for m in data if m["id"] == (self.model or models[0])), {})
        length = card.get("max_model_len")
        self._info = ServerInfo(models, length if isinstance(length, int) and length > 0 else None,
                                takes_priority=card.get("owned_by") == "chatloom")
        if self.model is None and models:
            self.model = models[0]
        return self._info

    async def health(self) -> str:
        """'ok', 'draining' or 'loading' from /health; ReplicaError when the server does not answer."""
        try:
            r = await self._client.get("/health")
        except httpx.HTTPError as exc:
            raise ReplicaError(f"{self.base_url}/health: {_describe(exc)}") from None
        if r.status_code == 200:
            return "ok"
        try:
            status = r.json().get("status")
        except (ValueError, AttributeError):
            status = None
        if status in ("draining", "loading"):
            return status
        raise ReplicaError(f"{self.base_url}/health answered {r.status_code}")

    async def load(self) -> BackendStats:
        """Load gauges from /metrics under vLLM's names (both KV-usage spellings)."""
        try:
            r = await self._client.get("/metrics")
            r.raise_for_status()
            text = r.text
        except httpx.HTTPError as exc:
            raise ReplicaError(f"{self.base_url}/metrics: {_describe(exc)}") from None
        wanted = {"vllm:num_requests_running": "num_requests_running",
                  "vllm:num_requests_waiting": "num_requests_waiting",
                  "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc": "kv_cache_usage_perc"}
        out: dict = {}
        try:
            for family in text_string_to_metric_families(text):
                key = wanted.get(family.name)
                if key is None or key in out:
                    continue
                # One value per model label; sum them (a server may host several).
                out[key] = sum(s.value for s in family.samples if s.name == family.name)
        except ValueError:
            raise ReplicaError(f"{self.base_url}/metrics is not Prometheus text") from None
        running, waiting = out.get("num_requests_running"), out.get("num_requests_waiting")
        return BackendStats(ready=True, model=self.model, kv_cache_usage_perc=out.get("kv_cache_usage_perc"),
                            num_requests_running=None if running is None else int(running),
                            num_requests_waiting=None if waiting is None else int(waiting))

    async def kv_events(self, after: int, wait: float) -> dict | None:
        """The server's prefix-cache feed after `after` (None: the server publishes none)."""
        try:
            r = await self._client.get("/v1/kv_events", params={"after": after, "timeout": wait},
                                       timeout=httpx.Timeout(wait + self.timeouts.probe, connect=self.timeouts.connect))
        except httpx.HTTPError as exc:
            raise ReplicaError(f"{self.base_url}/v1/kv_events: {_describe(exc)}") from None
        if r.status_code in (404, 405):
            return None
        body = _json_or_error(r.status_code, _body(r), f"{self.base_url}/v1/kv_events")
        if not isinstance(body.get("events"), list) or not isinstance(body.get("last_seq"), int):
            raise ReplicaError(f"{self.base_url}/v1/kv_events answered an unknown shape")
        return body

    async def tokenize(self, messages: list[dict] | None = None, prompt: str | None = None) -> list[int]:
        """Token ids from the server's /tokenize (chatloom and vLLM both have one)."""
        body: dict = {"model": self.model}
        if messages is not None:
            body.update(messages=messages, add_generation_prompt=True)
        else:
            body["prompt"] = prompt or ""
        try:
            # On the request's path: a saturated replica is slow to accept, not gone (the stream's timeouts).
            r = await self._answers.post("/tokenize", body)
        except AnswerHTTPError as exc:
            raise ReplicaError(f"{self.base_url}/tokenize: {exc}") from None
        tokens = _json_or_error(r.status, r.body, f"{self.base_url}/tokenize").get("tokens")
        if not isinstance(tokens, list):
            raise ReplicaError(f"{self.base_url}/tokenize answered no token list")
        return tokens

    # -- streaming ------------------------------------------------------------------------
    async def _stream(self, path: str, body: dict, request_id: str | None) -> AsyncIterator[dict]:
        """The JSON chunks of an SSE answer. 4xx: BadGenerationRequest; anything broken: ReplicaError."""
        where = f"{self.base_url}{path}"
        try:
            async with self._answers.stream(path, body) as r:
                if r.status != 200:
                    _json_or_error(r.status, await r.read_json(), where)  # raises with the server's own message
                    raise ReplicaError(f"{where} answered {r.status}")
                if request_id is not None:
                    self._responses[request_id] = r
                done = False
                try:
                    async for line in r.lines():
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            break
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            raise ReplicaError(f"{where} streamed something that is not JSON") from None
                        if isinstance(chunk, dict) and "error" in chunk:
                            raise ReplicaError(f"{where} failed mid-answer: {error_message(chunk)}")
                        yield chunk
                finally:
                    if request_id is not None:
                        self._responses.pop(request_id, None)
                if not done:
                    raise ReplicaError(f"{where}: the stream ended without [DONE] (server died?)")
        except AnswerHTTPError as exc:
            raise (ReplicaTimeout if exc.timed_out else ReplicaError)(f"{where}: {exc}") from None

    async def stream_tokens(self, prompt_ids: list[int], params: SamplingParams,
                            request_id: str | None = None, logprobs: int | None = None,
                            priority: int = 0) -> AsyncIterator[TokenChunk]:
        """Generate from a token-id prompt; every chunk carries its token ids (and, with `logprobs`, the
        log probabilities the server gives for them). `priority` as GenerationRequest's (lower runs first)."""
        body = {"model": self.model, "prompt": prompt_ids, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}, **sampling_to_body(params), **self._priority(priority)}
        if params.keep_kv and request_id is not None:  # kept under the request's id when it ends
            body["kv_handle"] = request_id
        if logprobs is not None:
            body["logprobs"] = logprobs
        finish: TokenChunk | None = None
        async for chunk in self._stream("/v1/completions", body, request_id):
            choices = chunk.get("choices") or []
            if choices:
                c = choices[0]
                ids = c.get("token_ids")
                if ids is None:
                    raise ReplicaError(f"{self.base_url} returns no token ids (chatloom replicas and vLLM "
                                       f">= 0.10.2 do, with return_token_ids)")
                piece = TokenChunk(c.get("text") or "", list(ids), c.get("finish_reason"),
                                   logprobs=completion_logprobs(c.get("logprobs")) if logprobs is not None else None)
                if piece.finish_reason is not None:
                    finish = piece  # usage may follow in its own chunk
                    continue
                yield piece
            elif chunk.get("usage") and finish is not None:
                finish.usage = chunk["usage"]
        if finish is None:
            raise ReplicaError(f"{self.base_url}: the answer ended without a finish reason")
        yield finish

    async def embed(self, inputs: list[EmbedInput], model: str | None = None) -> Embeddings:
        """The server's /v1/embeddings (float vectors; chatloom replicas and vLLM serve it)."""
        self.resolve_model(model)
        where = f"{self.base_url}/v1/embeddings"
        body = {"model": self.model, "input": list(inputs), "encoding_format": "float"}
        try:
            r = await self._client.post("/v1/embeddings", json=body, timeout=httpx.Timeout(
                self.timeouts.between_chunks, connect=self.timeouts.stream_connect))
        except httpx.TimeoutException as exc:
            raise ReplicaTimeout(f"{where}: {_describe(exc)}") from None
        except httpx.HTTPError as exc:
            raise ReplicaError(f"{where}: {_describe(exc)}") from None
        answer = _json_or_error(r.status_code, _body(r), where)
        data = answer.get("data")
        try:
            rows = sorted(data, key=lambda d: d["index"])
            vectors = [[float(x) for x in d["embedding"]] for d in rows]
        except (TypeError, KeyError, ValueError):
            raise ReplicaError(f"{where} answered no embedding list") from None
        if len(vectors) != len(inputs):
            raise ReplicaError(f"{where} answered {len(vectors)} embeddings for {len(inputs)} inputs")
        usage = answer.get("usage") or {}
        tokens = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else \
            self.embedding_tokens(inputs)
        return Embeddings(vectors, tokens)

    def hold_kv(self, request_id: str, tools: list[str], policy: str, timeout_s: float) -> None:
        self._post_soon("/kv/hold", {"handle": request_id, "tools": list(tools), "policy": policy,
                                     "timeout_s": timeout_s})

    def release_kv(self, request_id: str) -> None:
        self._post_soon("/kv/release", {"handle": request_id})

    def _post_soon(self, path: str, body: dict) -> None:
        """A KV instruction, sent in the background: a replica that misses it frees the cache at its timeout."""
        import asyncio

        async def post() -> None:
            try:
                await self._client.post(path, json=body)
            except httpx.HTTPError as exc:
                log.info("%s%s: %s", self.base_url, path, _describe(exc))

        task = asyncio.ensure_future(post())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def abort(self, request_id: str) -> None:
        """Close the request's connection; the server aborts it."""
        r = self._responses.pop(request_id, None)
        if r is not None:
            r.close()

    # -- the Backend API ---------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self.probe()
            self._error = None
        except ReplicaError as exc:
            self._error = str(exc)
            raise BackendNotReady(str(exc)) from None

    async def close(self) -> None:
        await self._answers.aclose()
        await self._client.aclose()

    @property
    def ready(self) -> bool:
        return self._info is not None

    @property
    def load_error(self) -> str | None:
        return self._error

    @property
    def model_ids(self) -> list[str]:
        return [self.model or "default"]

    @property
    def context_window(self) -> int:
        return (self._info and self._info.max_model_len) or 2048

    @property
    def tokenizer(self):
        return self._tokenizer

    def count_tokens(self, text: str) -> int:
        return count_text_tokens(self._tokenizer, text)

    def count_prompt_tokens(self, messages: list[dict]) -> int:
        return count_chat_tokens(self._tokenizer, messages)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        self.resolve_model(request.model)
        params = sampling_params(request)
        if request.prompt_logprobs is not None:
            raise BadGenerationRequest("the prompt's logprobs (echo with logprobs) are not supported by a remote "
                                       "backend", "unsupported_value", "echo")
        if request.messages is not None and self._tokenizer is None:
            async for delta in self._stream_chat(request, params):
                yield delta
            return
        if request.n > 1:
            raise BadGenerationRequest("n above 1 is not supported by a remote backend that sends token ids",
                                       "unsupported_value", "n")
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        elif request.messages is not None:
            ids = encode_chat(self._tokenizer, request.messages)
        elif request.prompt is not None:
            ids = (self._tokenizer.encode(request.prompt) if self._tokenizer is not None
                   else await self.tokenize(prompt=request.prompt))
        else:
            raise BadGenerationRequest("a request needs messages or a prompt", param="messages")
        async for piece in self.stream_tokens(ids, params, request.request_id, request.logprobs, request.priority):
            if piece.finish_reason is None:
                yield Delta(piece.text, logprobs=piece.logprobs)
            else:
                u = piece.usage or {}
                yield Delta(piece.text, True, piece.finish_reason, u.get("prompt_tokens", len(ids)),
                            u.get("completion_tokens", 0),
                            (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0, logprobs=piece.logprobs)

    async def _stream_chat(self, request: GenerationRequest, params: SamplingParams) -> AsyncIterator[Delta]:
        """A chat request as chat completions (no local tokenizer): its n choices and logprobs passed through."""
        body = {"model": self.model, "messages": request.messages, "stream": True,
                "stream_options": {"include_usage": True}, **sampling_to_body(params),
                **self._priority(request.priority)}
        if request.n > 1:
            body["n"] = request.n
        if request.logprobs is not None:
            body.update(logprobs=True, top_logprobs=request.logprobs)
        finals: dict[int, Delta] = {}
        usage: dict = {}
        async for chunk in self._stream("/v1/chat/completions", body, request.request_id):
            for c in chunk.get("choices") or []:
                index = c.get("index") or 0
                text = (c.get("delta") or {}).get("content") or ""
                found = chat_logprobs(c.get("logprobs")) if request.logprobs is not None else None
                if c.get("finish_reason"):
                    finals[index] = Delta(text, True, c["finish_reason"], index=index, logprobs=found)
                elif text or found:
                    yield Delta(text, index=index, logprobs=found)
            usage = chunk.get("usage") or usage
        if len(finals) < request.n:
            raise ReplicaError(f"{self.base_url}: the answer ended without a finish reason")
        for index in sorted(finals):  # the counts cover every choice: they go on the first
            final = finals[index]
            if index == 0:
                final.prompt_tokens = usage.get("prompt_tokens", 0)
                final.completion_tokens = usage.get("completion_tokens", 0)
                final.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            yield final


def chat_logprobs(found: dict | None) -> list[TextLogprob]:
    """A chat chunk's `logprobs.content` (OpenAI's shape) as TextLogprob entries."""
    entries = (found or {}).get("content") or []
    return [TextLogprob(e.get("token", ""), e.get("logprob"), e.get("bytes"),
                        tuple(TextLogprob(t.get("token", ""), t.get("logprob"), t.get("bytes"))
                              for t in e.get("top_logprobs") or []))
            for e in entries if isinstance(e, dict)]


def completion_logprobs(found: dict | None) -> list[TextLogprob]:
    """A completion chunk's logprobs (the legacy shape: tokens, token_logprobs, top_logprobs) as entries."""
    found = found or {}
    tokens, values = found.get("tokens") or [], found.get("token_logprobs") or []
    tops = found.get("top_logprobs") or [None] * len(tokens)
    return [TextLogprob(t, v, None, tuple(TextLogprob(k, lp) for k, lp in sorted((top or {}).items(),
                                                                                  key=lambda kv: -kv[1])))
            for t, v, top in zip(tokens, values, tops)]


def sampling_params(request: GenerationRequest) -> SamplingParams:
    """The engine's sampling values for a request sent to replicas (the remote backend and the router).
    Output constraints are refused here: the replica protocol carries no grammar, and sending the
    request unconstrained would break the promise a schema or a forced tool call makes."""
    if request.constraint is not None:
        raise BadGenerationRequest("structured output (response_format, forced tool calls) is not supported "
                                   "by a remote or routed backend; send it to an in-process model",
                                   "unsupported_constraint", "response_format")
    try:
        return SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                              top_k=request.top_k, seed=request.seed, stop=list(request.stop),
                              keep_kv=request.keep_kv, resume_of=request.resume_of)
    except InvalidRequest as exc:
        raise BadGenerationRequest(str(exc)) from None


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The chat prompt's token ids, exactly as a chatloom engine would build them."""
    from chatloom.models.chat_template import render_chat
    from chatloom.models.config import ModelError

    try:
        text = render_chat(tokenizer.chat_template, messages, add_generation_prompt=True,
                           bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    except ModelError as exc:
        raise BadGenerationRequest(str(exc), "invalid_messages", "messages") from None
    return tokenizer.encode(text, add_special=not (tokenizer.bos_token and text.startswith(tokenizer.bos_token)))


def _describe(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused or host unreachable"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return "the connection broke (server died?)"
    return f"{type(exc).__name__}: {exc}"


def _body(r: httpx.Response) -> object:
    """An httpx answer's body as JSON; None when it is not JSON."""
    try:
        return r.json()
    except ValueError:
        return None


def _json_or_error(status: int, body: object, where: str) -> dict:
    """The JSON object `body` of a 2xx answer; the server's own message for 4xx; ReplicaError otherwise."""
    if 400 <= status < 500 and status not in (404, 408, 429) or (
            status == 404 and isinstance(body, dict) and _code(body) == "model_not_found"):
        message = error_message(body) or f"{where} refused the request ({status})"
        if status == 404:
            raise ReplicaModelMismatch(message)
        raise BadGenerationRequest(message, _code(body) or "invalid_request")
    if status >= 300:
        raise ReplicaError(f"{where} answered {status}: {error_message(body) or 'no error message'}")
    if not isinstance(body, dict):
        raise ReplicaError(f"{where} did not answer JSON (is it an OpenAI-compatible server?)")
    return body


def _code(body) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("code") if isinstance(err, dict) and isinstance(err.get("code"), str) else None
