"""The synchronous engine: add requests, step, read outputs."""
from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from chatloom.engine.block_manager import BlockManager
from chatloom.engine.config import EngineConfig
from chatloom.engine.detokenizer import IncrementalDetokenizer
from chatloom.engine.model_runner import ModelRunner
from chatloom.engine.outputs import RequestOutput
from chatloom.engine.sampler import Sampler
from chatloom.engine.sampling_params import InvalidRequest, SamplingParams
from chatloom.engine.scheduler import Scheduler, SchedulerConfig
from chatloom.engine.sequence import Sequence, SequenceStatus
from chatloom.engine.stats import EngineSnapshot, EngineStats
from chatloom.engine.structured.guide import GrammarGuide
from chatloom.models.loader import LoadedModel


class _RequestState:
    """Per-request text state the engine keeps beside the Sequence."""

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer) -> None:
        self.seq = seq
        self.detok = detok
        self.emitted = 0  # characters of detok.text already handed out
        self.max_stop_len = max((len(s) for s in seq.params.stop), default=0)
        self.stopped_by_string = False


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(loaded.dtype, "fp32")
        bytes_per_token = cfg.kv_bytes_per_token(dtype_name) * (2 if loaded.dtype == torch.float64 else 1)
        num_blocks = self.config.resolve_num_blocks(bytes_per_token)
        self.max_model_len = self.config.max_model_len or min(cfg.max_position, 8192)
        self.block_manager = BlockManager(num_blocks, self.config.block_size, loaded.id,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs, max_model_len=self.max_model_len,
            enable_chunked_prefill=self.config.enable_chunked_prefill), self.block_manager)
        self.runner = ModelRunner(loaded.model, num_blocks, self.config.block_size)
        self.sampler = Sampler(self.config.seed)
        self.eos_ids = list(self.tokenizer.eos_token_ids)
        self.requests: dict[str, _RequestState] = {}
        self.guide = GrammarGuide(self.tokenizer, self.eos_ids)  # matchers of constrained requests
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._finished_outputs: deque[RequestOutput] = deque()

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
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        now = time.time()
        scheduled = batch.decodes + [s for s, _ in batch.prefills]
        for seq in scheduled:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        logits, argmax, sampled = self.runner.execute(batch)
        if sampled and len(self.guide) and self.guide.apply(logits, [s.request_id for s in sampled]):
            argmax = None  # masked rows: the runner's argmax may be a forbidden token
        new_tokens = self.sampler(logits, sampled, self.eos_ids, argmax) if sampled else []

        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
        now = time.time()
        for seq, token in zip(sampled, new_tokens):
            seq.token_ids.append(token)
            self.guide.advance(seq.request_id, token)
            m = seq.metrics
            m.num_output_tokens = seq.num_output_tokens
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            out = self._advance(self.requests[seq.request_id], token)
            if out is not None:
                outputs.append(out)
        for seq in scheduled:
            if not seq.is_finished:
                self.block_manager.register_full_blocks(seq)
        self.stats.record_step(batch.num_tokens, len(new_tokens), now)
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
            hits = [i for i in (text.find(s, window_start) for s in p.stop) if i >= 0]
            if hits:
                state.detok.text = text[:min(hits)]
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

    def _finish(self, state: _RequestState, reason: str, emit: bool = True) -> RequestOutput:
        seq = state.seq
        self.scheduler.remove(seq)
        self.guide.remove(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.time()
        del self.requests[seq.request_id]
        if not state.stopped_by_string:
            state.detok.flush()
        text = state.detok.text
        delta = text[state.emitted:]
        state.emitted = len(text)
        out = RequestOutput(seq.request_id, delta, [], text, finished=True, finish_reason=reason,
                            num_prompt_tokens=seq.prompt_len, num_output_tokens=seq.num_output_tokens,
                            num_cached_tokens=seq.metrics.num_cached_tokens, metrics=seq.metrics,
                            token_ids=seq.output_token_ids)
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
            kv_cache_usage_perc=bm.usage, kv_cache_blocks=bm.num_blocks, kv_cache_free_blocks=bm.num_free_blocks,
            block_size=bm.block_size, prefix_cache_queries=bm.query_tokens, prefix_cache_hits=bm.hit_tokens,
            prefix_cache_hit_rate=bm.hit_rate, prefix_cache_evictions=bm.evictions,
            num_preemptions=self.scheduler.num_preemptions, steps=st.steps, generated_tokens=st.generated_tokens,
            aborted_requests=st.aborted, generation_tokens_per_s=round(st.tokens_per_s(), 2))

    def get_stats(self) -> dict:
        """The snapshot as a plain dict (for printing and JSON)."""
        return self.snapshot().as_dict()
