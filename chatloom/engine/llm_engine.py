"""The synchronous engine: add requests, step, read outputs."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque

from chatloom.engine.block_manager import BlockManager
from chatloom.engine.config import EngineConfig, resolve_kv_cache_dtype
from chatloom.engine.detokenizer import IncrementalDetokenizer
from chatloom.engine.isolation import execute_isolated
from chatloom.engine.kv_events import KVEventLog
from chatloom.engine.model_runner import ModelRunner
from chatloom.engine.outputs import RequestOutput
from chatloom.engine.sampler import Sampler
from chatloom.engine.sampling_params import InvalidRequest, SamplingParams
from chatloom.engine.scheduler import Scheduler, SchedulerConfig
from chatloom.engine.sequence import Sequence, SequenceStatus
from chatloom.engine.spec_decode import build_speculative_decoder
from chatloom.engine.spec_decode.calibrate import calibrate_decoder
from chatloom.engine.stats import EngineSnapshot, EngineStats
from chatloom.engine.structured.guide import GrammarGuide
from chatloom.models.loader import LoadedModel
from chatloom.models.packed_linear import uses_int8_matmul

log = logging.getLogger(__name__)


class _RequestState:
    """Per-request text state the engine keeps beside the Sequence."""

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer) -> None:
        self.seq = seq
        self.detok = detok
        self.emitted = 0  # characters of detok.text already handed out
        self.max_stop_len = max((len(s) for s in seq.params.stop), default=0)
        self.stopped_by_string = False
        self.stop_str: str | None = None  # the stop string that ended the request


def _merge(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output for several tokens of a request in one step (speculative decoding)."""
    then.delta_text = first.delta_text + then.delta_text
    then.delta_token_ids = first.delta_token_ids + then.delta_token_ids
    return then


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.config.kv_cache_dtype, loaded.dtype,
                                                     uses_int8_matmul(loaded.model))
        bytes_per_token = cfg.kv_bytes_per_token("fp32") * self.kv_cache_dtype.itemsize // 4
        num_blocks = self.config.resolve_num_blocks(bytes_per_token)
        self.max_model_len = self.config.max_model_len or min(cfg.max_position, 8192)
        # The prefix cache's stored/evicted keys, numbered: a replica publishes them to routers.
        self.kv_events = KVEventLog(loaded.id, self.config.block_size)
        self.block_manager = BlockManager(num_blocks, self.config.block_size, loaded.id,
                                          self.config.enable_prefix_caching, self.kv_events)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs, max_model_len=self.max_model_len,
            enable_chunked_prefill=self.config.enable_chunked_prefill), self.block_manager)
        self.runner = ModelRunner(loaded.model, num_blocks, self.config.block_size,
                                  kv_cache_dtype=self.kv_cache_dtype)
        # A prompt that agrees with part of a cached block takes that part's K/V from it.
        self.block_manager.copy_prefix = self.runner.copy_block_prefix
        self.sampler = Sampler(self.config.seed)
        self.eos_ids = list(self.tokenizer.eos_token_ids)
        self.requests: dict[str, _RequestState] = {}
        self.guide = GrammarGuide(self.tokenizer, self.eos_ids)  # matchers of constrained requests
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._finished_outputs: deque[RequestOutput] = deque()
        self.spec = build_speculative_decoder(self.config, self.max_model_len, loaded, num_blocks)
        if self.spec is not None and self.spec.adaptive:
            calibrate_decoder(self.spec, self.runner, self.config)

    # -- requests ---------------------------------------------------------------
    @property
    def pool_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> str:
        params = params or SamplingParams()
        token_ids = self.encode_prompt(prompt)
        if not token_ids:
            raise InvalidRequest("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(token_ids)} tokens; the context window is "
                                 f"{self.max_model_len} tokens, and the answer needs room too")
        if min(len(token_ids) + params.max_tokens, self.max_model_len) > self.pool_tokens:
            raise InvalidRequest(f"the request needs up to {len(token_ids) + params.max_tokens} tokens "
                                 f"of KV cache; the pool holds {self.pool_tokens}")
        vocab = self.loaded.config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise InvalidRequest("prompt token ids must be within the vocabulary")
        if any(t < 0 or t >= vocab for t in params.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be within the vocabulary")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if params.constraint is not None:
            self.guide.add(request_id, params.constraint)
        seq = Sequence(request_id, token_ids, params, priority)
        self.requests[request_id] = _RequestState(seq, IncrementalDetokenizer(self.tokenizer))
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its blocks are free when this returns."""
        state = self.requests.get(request_id)
        if state is None:
            return False
        self._finish(state, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._finished_outputs)

    # -- stepping -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, forward, sample, detokenize. Returns this step's outputs."""
        outputs = list(self._finished_outputs)
        self._finished_outputs.clear()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        now = time.time()
        scheduled = batch.decodes + [s for s, _ in batch.prefills]
        for seq in scheduled:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        t0 = time.perf_counter()
        # A failure is attributed to the sequences it belongs to; the rest of the batch carries on.
        fwd = execute_isolated(self.runner, batch)
        outputs += [o for seq, exc in fwd.failed.items() if (o := self._fail(seq, f"the forward pass failed: {exc!r}"))]
        logits, argmax, sampled, picks = fwd.logits, fwd.argmax, fwd.sampled, fwd.picks
        if sampled and len(self.guide):
            # One logits row per sampled sequence plus one per proposal; constrained ones never propose,
            # so their single row is masked here, before verification or sampling.
            row_ids = [rid for s in sampled for rid in [s.request_id] + [""] * len(s.spec_token_ids)]
            if self.guide.apply(logits, row_ids):
                argmax = picks = None  # masked rows: the runner's argmax may be a forbidden token
        failures: dict = {}
        if self.spec is not None and not batch.prefills and not fwd.failed:
            self.spec.observe_step(batch.num_tokens, time.perf_counter() - t0)
        if self.spec is not None and any(s.spec_token_ids for s in sampled):
            new_tokens, failures = self.spec.verify(logits, argmax, sampled, self.sampler, self.eos_ids, picks)
        else:
            drawn, failures = self.sampler.sample(logits, sampled, self.eos_ids, argmax, picks) if sampled else ([], {})
            new_tokens = [[t] for t in drawn]

        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
        now = time.time()
        num_new = 0
        for row, (seq, tokens) in enumerate(zip(sampled, new_tokens)):
            if row in failures:  # this row alone could not be sampled
                out = self._fail(seq, f"sampling failed: {failures[row]}")
                if out is not None:
                    outputs.append(out)
                continue
            # Kept proposals are computed already: their K/V went in with this step's forward.
            seq.num_computed_tokens += len(tokens) - 1
            had_proposals = bool(seq.spec_token_ids)
            seq.spec_token_ids = []
            state = self.requests[seq.request_id]
            merged: RequestOutput | None = None
            appended = 0
            for token in tokens:
                seq.token_ids.append(token)
                self.guide.advance(seq.request_id, token)
                appended += 1
                m = seq.metrics
                m.num_output_tokens = seq.num_output_tokens
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
                try:
                    out = self._advance(state, token)
                except Exception as exc:  # detokenizing or stop matching: this request's problem alone
                    out = self._fail(seq, f"decoding the output failed: {exc!r}")
                    merged = None
                    if out is not None:
                        outputs.append(out)
                    break
                merged = out if merged is None else _merge(merged, out)
                if seq.is_finished:
                    break
            num_new += appended
            if merged is not None:
                outputs.append(merged)
            if had_proposals:
                if not seq.is_finished:
                    # Roll back the blocks that only held rejected proposals.
                    self.block_manager.trim(seq, len(seq))
                self.spec.verified(seq, appended)
        for seq in scheduled:
            if not seq.is_finished:
                self.block_manager.register_full_blocks(seq)
        self.stats.record_step(batch.num_tokens, num_new, now)
        return outputs

    def _advance(self, state: _RequestState, token: int) -> RequestOutput | None:
        seq, p = state.seq, state.seq.params
        reason = None
        is_eos = token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)
        if is_eos and seq.num_output_tokens >= p.min_tokens:
            reason = "stop"
        else:
            state.detok.add(token)
        if reason is None and p.stop and seq.num_output_tokens >= p.min_tokens:
            text = state.detok.text
            window_start = max(0, state.emitted - state.max_stop_len)
            hits = [(i, s) for s in p.stop if (i := text.find(s, window_start)) >= 0]
            if hits:
                at, state.stop_str = min(hits, key=lambda hit: hit[0])
                state.detok.text = text[:at]
                state.stopped_by_string = True
                reason = "stop"
        if reason is None and (seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len):
            reason = "length"
        if reason is not None:
            return self._finish(state, reason, emit=False)
        # Hold back text that might be the start of a stop string.
        safe = len(state.detok.text) - (state.max_stop_len - 1 if state.max_stop_len else 0)
        if safe <= state.emitted:
            return RequestOutput(seq.request_id, "", [token], state.detok.text[:state.emitted],
                                 num_prompt_tokens=seq.prompt_len, num_output_tokens=seq.num_output_tokens)
        delta = state.detok.text[state.emitted:safe]
        state.emitted = safe
        return RequestOutput(seq.request_id, delta, [token], state.detok.text[:safe],
                             num_prompt_tokens=seq.prompt_len, num_output_tokens=seq.num_output_tokens)

    def _fail(self, seq: Sequence, message: str) -> RequestOutput | None:
        """Finish one request with finish_reason 'error'; its blocks are freed, nothing else is touched."""
        state = self.requests.get(seq.request_id)
        if state is None:  # already finished (aborted meanwhile)
            return None
        log.warning("request %s failed: %s", seq.request_id, message)
        self.stats.failed += 1
        out = self._finish(state, "error", emit=False)
        out.error = message
        return out

    def _finish(self, state: _RequestState, reason: str, emit: bool = True) -> RequestOutput:
        seq = state.seq
        self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.forget(seq)
        self.guide.remove(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.time()
        del self.requests[seq.request_id]
        if not state.stopped_by_string and reason != "error":
            state.detok.flush()
        text = state.detok.text
        delta = text[state.emitted:]
        state.emitted = len(text)
        out = RequestOutput(seq.request_id, delta, [], text, finished=True, finish_reason=reason,
                            num_prompt_tokens=seq.prompt_len, num_output_tokens=seq.num_output_tokens,
                            num_cached_tokens=seq.metrics.num_cached_tokens, metrics=seq.metrics,
                            token_ids=seq.output_token_ids, stop_str=state.stop_str)
        if reason == "abort":
            self.stats.aborted += 1
        if emit:
            self._finished_outputs.append(out)
        return out

    # -- offline use --------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generating", unit="req", leave=False)
        while len(results) < len(ids):
            for out in self.step():
                if out.finished:
                    results[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [results[i] for i in ids]

    def snapshot(self) -> EngineSnapshot:
        bm, st = self.block_manager, self.stats
        return EngineSnapshot(
            num_requests_running=len(self.scheduler.running), num_requests_waiting=len(self.scheduler.waiting),
            num_waiting_tokens=sum(len(s) - s.num_computed_tokens for s in list(self.scheduler.waiting)),
            kv_cache_usage_perc=bm.usage, kv_cache_blocks=bm.num_blocks, kv_cache_free_blocks=bm.num_free_blocks,
            block_size=bm.block_size, prefix_cache_queries=bm.query_tokens, prefix_cache_hits=bm.hit_tokens,
            prefix_cache_hit_rate=bm.hit_rate, prefix_cache_evictions=bm.evictions,
            num_preemptions=self.scheduler.num_preemptions, steps=st.steps, generated_tokens=st.generated_tokens,
            aborted_requests=st.aborted, generation_tokens_per_s=round(st.tokens_per_s(), 2),
            failed_requests=st.failed,
            spec_decode=dataclasses.replace(self.spec.stats) if self.spec is not None else None)

    def get_stats(self) -> dict:
        """The snapshot as a plain dict (for printing and JSON)."""
        return self.snapshot().as_dict()
