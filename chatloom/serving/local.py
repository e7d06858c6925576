"""The chatloom engine running in this process, behind the Backend interface."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import AsyncIterator

from chatloom.engine import EngineConfig, InvalidRequest, RequestOutput, SamplingParams
from chatloom.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from chatloom.engine.config import resolve_kv_cache_dtype
from chatloom.engine.kv_sizing import uniform_window
from chatloom.engine.outputs import TokenLogprob
from chatloom.engine.thread_pool import then_release
from chatloom.models import LoadedModel, ModelError, describe_config, load_model
from chatloom.models.vision.mmproj import attach_mmproj
from chatloom.models.chat_template import encode_chat
from chatloom.models.loader import resolve_dtype
from chatloom.models.token_bytes import TokenBytes
from chatloom.models.registry import DEFAULT_MODEL, REGISTRY
from chatloom.models.hf_loader import read_vision_config
from chatloom.models.vision.prompt import ImageInput
from chatloom.serving.images import ImageError, encode_vision_chat, message_images
from chatloom.serving.backend import (Backend, BackendError, BackendNotReady, BackendStats, BadGenerationRequest,
                                      Delta, EmbedInput, Embeddings, GenerationRequest, ModelLoadFailed, TextLogprob,
                                      Timings)

log = logging.getLogger(__name__)


def model_id_for(spec: str) -> str:
    """The id a model spec will be served under, known before loading (matches load_model)."""
    return spec if spec in REGISTRY else Path(spec).stem


class LocalBackend(Backend):
    """Wraps an AsyncEngine. Construct with a model spec (loaded by start()) or a LoadedModel."""

    def __init__(self, model: str | LoadedModel = DEFAULT_MODEL, dtype: str = "fp32",
                 engine_config: EngineConfig | None = None, int8_matmul: bool | None = False,
                 bf16_matmul: bool = False, pooling: str = "last", mmproj: str | None = None) -> None:
        self._loaded = model if isinstance(model, LoadedModel) else None
        self._spec = model.id if isinstance(model, LoadedModel) else model
        self._dtype = dtype
        self._int8_matmul = int8_matmul
        self._bf16_matmul = bf16_matmul
        self._mmproj = mmproj  # a GGUF decoder's image side (models/vision/mmproj.py)
        self._config = engine_config or EngineConfig()
        self.pooling = pooling  # how embed() pools the hidden states: "last" or "mean" (engine/embedding.py)
        self._engine: AsyncEngine | None = None
        self._error: str | None = None
        self._start_lock = asyncio.Lock()
        # Recent chat prompts' token ids (and where their images go), oldest first.
        self._encoded: dict[tuple, tuple[list[int], list[ImageInput]]] = {}
        self._token_bytes: TokenBytes | None = None  # made at the first request for logprobs

    def kv_cache_bytes(self, cfg) -> int:
        """The KV pool the engine will allocate for a model config (checked with the weights)."""
        kv_dtype = resolve_kv_cache_dtype(self._config.kv_cache_dtype, resolve_dtype(self._dtype),
                                          self._int8_matmul, self._bf16_matmul)
        per_token = cfg.kv_bytes_per_token("fp32") * kv_dtype.itemsize // 4
        return self._config.plan_kv_pool(per_token, cfg.max_position, uniform_window(cfg.layer_windows)).bytes

    # -- lifecycle ----------------------------------------------------------------
    def check(self) -> None:
        if self._loaded is None:
            describe_config(self._spec)  # the config alone: quick, and the same reader load_model uses
            if self._mmproj and not Path(self._mmproj).is_file():
                raise ModelError(f"no such projector file: {self._mmproj}")

    async def start(self) -> None:
        async with self._start_lock:
            if self._engine is not None:
                return
            try:
                if self._loaded is None:
                    log.info("loading model %s", self._spec)
                    self._loaded = await asyncio.to_thread(then_release, load_model, self._spec, self._dtype,
                                                           self._int8_matmul, self.kv_cache_bytes, self._bf16_matmul)
                    if self._mmproj:
                        await asyncio.to_thread(attach_mmproj, self._loaded, self._mmproj)
                # Allocating the KV pool takes a moment for big pools; keep the event loop free. The
                # executor thread keeps living: it gives back its OpenMP pool (engine/thread_pool.py).
                self._engine = await asyncio.to_thread(then_release, AsyncEngine.from_model, self._loaded,
                                                       self._config)
                self._error = None
                log.info("model %s ready (context window %d tokens)", self._loaded.id, self.context_window)
            except (ModelError, OSError, ValueError, RuntimeError) as exc:
                self._error = str(exc)
                log.error("model %s failed to load: %s", self._spec, exc)
                raise ModelLoadFailed(f"model failed to load: {exc}") from exc

    async def close(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await asyncio.to_thread(engine.shutdown)

    @property
    def ready(self) -> bool:
        return self._engine is not None

    @property
    def load_error(self) -> str | None:
        return self._error

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise BackendNotReady(self._error and f"model failed to load: {self._error}" or "the model is loading")
        return self._engine

    # -- models -------------------------------------------------------------------
    @property
    def model_ids(self) -> list[str]:
        return [self._loaded.id if self._loaded is not None else model_id_for(self._spec)]

    @property
    def context_window(self) -> int:
        # What one request can really use: the model's window, or the whole KV pool if that is smaller
        # (a request larger than the pool could never be scheduled).
        if self._engine is not None:
            return min(self._engine.engine.max_model_len, self._engine.engine.pool_tokens)
        if self._loaded is not None:
            return self._config.resolve_max_model_len(self._loaded.config.max_position)
        return self._config.max_model_len or 0

    @property
    def kv_pool_tokens(self) -> int | None:
        return self._engine.engine.pool_tokens if self._engine is not None else None

    # -- tokens -------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special=False))

    def takes_images(self, model: str | None = None) -> bool:
        if self._loaded is not None:
            return self._loaded.vision is not None
        path = Path(self._spec)
        try:
            return path.is_dir() and read_vision_config(path) is not None
        except ModelError:
            return False

    def encode_messages(self, messages: list[dict], continue_final: bool = False) -> list[int]:
        return list(self._encode_cached(messages, continue_final)[0])

    def _encode_cached(self, messages: list[dict], continue_final: bool) -> tuple[list[int], list[ImageInput]]:
        # The gateway counts a prompt's tokens (quota, admission) and then streams the same messages:
        # the second call is served from this small cache instead of rendering and tokenizing again.
        key = (continue_final, repr([(m.get("role"), m.get("content"),
                                      [i.content_hash for i in m.get("images") or ()]) for m in messages]))
        found = self._encoded.get(key)
        if found is None:
            found = self._encode_messages(messages, continue_final)
            self._encoded[key] = found
            if len(self._encoded) > 64:
                self._encoded.pop(next(iter(self._encoded)))
        return found

    def _encode_messages(self, messages: list[dict], continue_final: bool) -> tuple[list[int], list[ImageInput]]:
        partial = ""
        if continue_final:  # the last message is the assistant's unfinished turn: go on from its text
            if not messages or messages[-1].get("role") != "assistant":
                raise BadGenerationRequest("continuing needs an assistant message last", "invalid_messages",
                                           "messages")
            messages, partial = messages[:-1], messages[-1].get("content") or ""
        loaded = self.engine.engine.loaded
        if loaded.vision is None and message_images(messages):
            raise BadGenerationRequest(f"model {loaded.id} does not take images; send text only", "unsupported_content",
                                       "messages")
        try:
            if loaded.vision is not None:  # its template reads content as text and image parts
                return encode_vision_chat(loaded, messages, partial)
            return encode_chat(self.tokenizer, messages, continue_text=partial), []
        except (ModelError, ImageError) as exc:
            raise BadGenerationRequest(str(exc), "invalid_messages", "messages") from None

    def count_prompt_tokens(self, messages: list[dict]) -> int:
        return len(self.encode_messages(messages))

    # -- generation -----------------------------------------------------------------
    def _prepare(self, request: GenerationRequest) -> tuple[list[int], SamplingParams, list[ImageInput]]:
        self.resolve_model(request.model)
        images: list[ImageInput] = []
        if request.messages is not None:
            ids, images = self._encode_cached(request.messages, request.continue_final)
            ids = list(ids)
        elif request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt)
        elif request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)  # the engine checks they are in the vocabulary
        else:
            raise BadGenerationRequest("a request needs messages or a prompt", param="messages")
        window = self.context_window
        if len(ids) >= window:
            raise BadGenerationRequest(
                f"the prompt has {len(ids)} tokens; this model's context window is {window} tokens "
                "and the answer needs room too", "context_length_exceeded", "messages")
        try:
            params = SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                                    top_p=request.top_p, top_k=request.top_k, seed=request.seed,
                                    stop=list(request.stop), constraint=request.constraint, n=request.n,
                                    logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs,
                                    keep_kv=request.keep_kv and request.n == 1, resume_of=request.resume_of)
        except InvalidRequest as exc:
            raise BadGenerationRequest(str(exc)) from None
        return ids, params, images

    async def stream(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        ids, params, images = self._prepare(request)
        if request.resume_token_ids:
            if params.n > 1:
                raise BadGenerationRequest("an answer of several choices cannot be resumed", param="n")
            async for delta in self._resume(request, ids, params, images):
                yield delta
            return
        sent = [0] * params.n  # output token ids handed out so far per choice (the finishing token arrives only on the last output)
        try:
            async for out in self.engine.stream(ids, params, request_id=request.request_id,
                                                priority=request.priority, images=images):
                metrics = _timings(out)
                new_ids = out.token_ids[sent[out.index]:] if out.finished else out.delta_token_ids
                sent[out.index] += len(new_ids)
                yield Delta(out.delta_text, out.finished, out.finish_reason, out.num_prompt_tokens,
                            out.num_output_tokens, out.num_cached_tokens, metrics, list(new_ids),
                            stop_sequence=out.stop_str, index=out.index, logprobs=self._texts(out.logprobs),
                            prompt_logprobs=self._texts(out.prompt_logprobs, ids))
        except InvalidRequest as exc:
            raise BadGenerationRequest(str(exc)) from None
        except EngineDeadError as exc:
            raise BackendError(str(exc)) from exc

    def _texts(self, entries: list[TokenLogprob | None] | None, prompt: list[int] | None = None) -> list | None:
        """The engine's logprobs (token ids) as the API shows them: each token's text and bytes. A prompt's
        first token, which has no logprob, is `prompt[0]`."""
        if entries is None:
            return None
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        as_bytes = self._token_bytes

        def text(token_id: int, logprob: float | None, top=()) -> TextLogprob:
            raw = as_bytes(token_id)
            # -inf (a token the model rules out) has no JSON spelling: vLLM's floor stands in for it.
            value = None if logprob is None else max(logprob, -9999.0)
            return TextLogprob(raw.decode("utf-8", errors="replace"), value, list(raw), top)

        return [text(prompt[i], None) if e is None else
                text(e.token_id, e.logprob, tuple(text(t, lp) for t, lp in e.top)) for i, e in enumerate(entries)]

    async def _resume(self, request: GenerationRequest, ids: list[int], params: SamplingParams,
                      images: list[ImageInput]):
        """The rest of an answer begun elsewhere: prompt + its tokens as the prompt, the text decoded
        from the whole answer (continuation.py), so the user's text goes on with no gap or repeat."""
        from chatloom.serving.continuation import AnswerProgress

        answer = AnswerProgress.resumed(params, self.tokenizer, request.resume_token_ids, request.resume_text)
        rest = answer.remaining_params()
        if rest is None:
            yield answer.finish(answer.natural_finish(), len(ids), 0, None)
            return
        sent = 0
        try:
            async for out in self.engine.stream(ids + answer.token_ids, rest, request_id=request.request_id,
                                                priority=request.priority, images=images):
                new_ids = out.token_ids[sent:] if out.finished else out.delta_token_ids
                sent += len(new_ids)
                text = answer.add(list(new_ids), out.delta_text, out.finished)
                if answer.stopped or out.finished:
                    if answer.stopped and not out.finished:
                        self.abort(out.request_id)
                    metrics = _timings(out)
                    final = answer.finish("stop" if answer.stopped else out.finish_reason, len(ids),
                                          out.num_cached_tokens, metrics, text)
                    final.token_ids = list(new_ids)
                    yield final
                    return
                yield Delta(text, token_ids=list(new_ids))
        except InvalidRequest as exc:
            raise BadGenerationRequest(str(exc)) from None
        except (EngineDeadError, RequestFailedError) as exc:
            raise BackendError(str(exc)) from exc

    # -- embeddings -------------------------------------------------------------------
    def _embedding_ids(self, inputs: list[EmbedInput]) -> list[list[int]]:
        return [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in inputs]

    def embedding_tokens(self, inputs: list[EmbedInput], model: str | None = None) -> int:
        return sum(len(ids) for ids in self._embedding_ids(inputs))

    def embedding_size(self, model: str | None = None) -> int | None:
        return self._loaded.config.hidden_size if self._loaded is not None else None

    async def embed(self, inputs: list[EmbedInput], model: str | None = None) -> Embeddings:
        self.resolve_model(model)
        ids = self._embedding_ids(inputs)
        try:
            vectors = await self.engine.embed(ids, self.pooling)
        except InvalidRequest as exc:
            raise BadGenerationRequest(str(exc), param="input") from None
        except EngineDeadError as exc:
            raise BackendError(str(exc)) from exc
        return Embeddings(vectors, sum(len(x) for x in ids))

    def abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.abort(request_id)

    def hold_kv(self, request_id: str, tools: list[str], policy: str, timeout_s: float) -> None:
        if self._engine is not None:
            self._engine.hold_kv(request_id, tools, policy, timeout_s)

    def release_kv(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.release_kv(request_id)

    def hold_background(self, held: bool) -> None:
        if self._engine is not None:
            self._engine.hold_background(held)

    def has_room(self, prompt_tokens: int) -> bool:
        """Room when the free KV blocks hold this prompt and every prompt already queued inside the
        engine, and a sequence slot is free. A non-empty engine queue alone is no reason to wait:
        prompts that arrive together are prefilled together in the next step (chunked within its
        token budget), so holding each one back for the previous to start would add a poll
        interval and a step to every first token under load."""
        if self._engine is None:
            return True  # stream() answers "not ready" at once; no point queueing for it
        s = self._engine.snapshot()
        if s.num_requests_running + s.num_requests_waiting >= self._engine.engine.config.max_num_seqs:
            return False
        # Blocks held for answers waiting on tools are as good as free: they give way to any request.
        free = s.kv_cache_free_blocks + (s.kv_holds.blocks_held if s.kv_holds is not None else 0)
        return free * s.block_size >= prompt_tokens + s.num_waiting_tokens

    def stats(self) -> BackendStats:
        if self._engine is None:
            return BackendStats(ready=False)
        s = self._engine.snapshot()
        return BackendStats(
            ready=True, model=self.default_model, context_window=self.context_window,
            num_requests_running=s.num_requests_running, num_requests_waiting=s.num_requests_waiting,
            kv_cache_usage_perc=s.kv_cache_usage_perc, kv_cache_blocks=s.kv_cache_blocks,
            kv_cache_free_blocks=s.kv_cache_free_blocks, block_size=s.block_size,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, interrupted_steps=s.interrupted_steps, step_seconds=s.step_seconds,
            generation_tokens_per_s=s.generation_tokens_per_s,
            spec_decode=s.spec_decode, kv_holds=s.kv_holds)


def _timings(out: RequestOutput) -> Timings | None:
    """The engine's latencies for a finished request, as the backend interface reports them."""
    m = out.metrics if out.finished else None
    return Timings(m.queue_time, m.ttft, m.tpot, m.e2e) if m is not None else None
