"""The synchronous engine: add requests, step, read outputs.

A step has three stages, as in nano-vllm and vLLM v1:

1. schedule: the scheduler plans which sequences run and how many tokens each (scheduler.py), with
   blocks from the KV-cache manager (kv_cache_manager.py over block_pool.py);
2. execute: one forward pass over the plan, the grammar mask, then sampling or speculative
   verification (executor.py), giving a ModelOutput;
3. update: the engine applies that output: tokens counted as computed, new tokens appended and turned
   into text and finish decisions (output_processor.py), rejected proposals' blocks trimmed, full
   blocks published in the prefix cache, engine counters recorded.

The engine owns the parts and each request's life: it admits requests, and frees a finished or
failed request's blocks, matcher and proposer state.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Mapping

from chatloom.engine.block_pool import BlockPool
from chatloom.engine.choices import plan_forks
from chatloom.engine.config import EngineConfig, SchedulerConfig, resolve_kv_cache_dtype
from chatloom.engine.embedding import Embedder
from chatloom.engine.encoder_cache import EncoderCache
from chatloom.engine.encoder_plan import EncoderPacer, EncoderPlanner
from chatloom.engine.executor import ModelOutput, StepExecutor
from chatloom.engine.heap import return_free_heap
from chatloom.engine.kv_cache_manager import KVCacheManager
from chatloom.engine.kv_events import KVEventLog
from chatloom.engine.kv_holds import KVHolds
from chatloom.engine.kv_sizing import uniform_window, window_tokens
from chatloom.engine.model_runner import ModelRunner
from chatloom.engine.output_processor import OutputProcessor, RequestState, merge_outputs
from chatloom.engine.outputs import RequestOutput, TokenLogprob
from chatloom.engine.sampler import Sampler
from chatloom.engine.sampling_params import InvalidRequest, SamplingParams
from chatloom.engine.scheduler import ScheduledBatch, Scheduler
from chatloom.engine.sequence import Sequence, SequenceStatus
from chatloom.engine.spec_decode import build_speculative_decoder
from chatloom.engine.spec_decode.calibrate import calibrate_decoder
from chatloom.engine.stats import EngineSnapshot, EngineStats
from chatloom.engine.structured.guide import GrammarGuide
from chatloom.models.loader import LoadedModel
from chatloom.models.vision.prompt import ImageInput
from chatloom.models.packed_linear import uses_bf16_matmul, uses_int8_matmul

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.config.kv_cache_dtype, loaded.dtype,
                                                     uses_int8_matmul(loaded.model), uses_bf16_matmul(loaded.model))
        bytes_per_token = cfg.kv_bytes_per_token("fp32") * self.kv_cache_dtype.itemsize // 4
        # Sized now, with the weights loaded: what is available is what the pool may share.
        self.kv_pool_plan = self.config.plan_kv_pool(bytes_per_token, cfg.max_position,
                                                     uniform_window(cfg.layer_windows))
        num_blocks = self.kv_pool_plan.blocks
        self.max_model_len = self.config.resolve_max_model_len(cfg.max_position)
        # The prefix cache's stored/evicted keys, numbered: a replica publishes them to routers.
        self.kv_events = KVEventLog(loaded.id, self.config.block_size)
        self.kv_cache_manager = KVCacheManager(BlockPool(num_blocks, self.config.block_size, loaded.id,
                                                         self.config.enable_prefix_caching, self.kv_events),
                                               window=uniform_window(cfg.layer_windows))
        device = loaded.model.embed_tokens.weight.device.type
        self.scheduler = Scheduler(SchedulerConfig.from_engine(self.config, self.max_model_len, device),
                                   self.kv_cache_manager)
        # Rounds whose blocks wait for their tools (kv_holds.py); they give way to any request short of blocks.
        self.kv_holds = KVHolds(self.kv_cache_manager)
        self.kv_cache_manager.holds = self.kv_holds
        self.scheduler.reclaim = lambda seq: self.kv_holds.reclaim(keep=seq.params.resume_of)
        self.encoder_cache = EncoderCache(int(self.config.encoder_cache_mb * 2**20))
        self.runner = ModelRunner(loaded.model, num_blocks, self.config.block_size,
                                  kv_cache_dtype=self.kv_cache_dtype, vision=loaded.vision,
                                  encoder_cache=self.encoder_cache)
        # A vision model's encoder work runs in pieces inside each step's budget (encoder_plan.py).
        self.encoder_pacer = EncoderPacer(self.config.encoder_max_slowdown)
        if loaded.vision is not None:
            embedding_bytes = cfg.hidden_size * next(loaded.vision.parameters()).element_size()
            self.scheduler.encoder = EncoderPlanner(self.encoder_cache, embedding_bytes,
                                                    self.config.max_num_batched_tokens, self.encoder_pacer,
                                                    loaded.vision.encoder_layers, loaded.vision.state_bytes)
        # A prompt that agrees with part of a cached block takes that part's K/V from it.
        self.kv_cache_manager.copy_prefix = self.runner.copy_block_prefix
        self.sampler = Sampler(self.config.seed)
        self.eos_ids = list(self.tokenizer.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_ids, self.max_model_len)
        self.guide = GrammarGuide(self.tokenizer, self.eos_ids)  # matchers of constrained requests
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._groups: dict[str, list[Sequence]] = {}  # the live choices of requests with n > 1, by request id
        self.spec = build_speculative_decoder(self.config, self.max_model_len, loaded, num_blocks)
        if self.spec is not None and self.spec.adaptive:
            calibrate_decoder(self.spec, self.runner, self.config)
        self.executor = StepExecutor(self.runner, self.sampler, self.guide, self.spec, self.eos_ids)
        # Embedding jobs: prefill-only passes between the steps, holding blocks only while they run.
        self.embedder = Embedder(self.runner, self.kv_cache_manager, self.config.max_num_batched_tokens,
                                 self.max_model_len, cfg.vocab_size)
        return_free_heap()  # what loading freed, back to the machine before serving

    # -- requests ---------------------------------------------------------------
    @property
    def pool_tokens(self) -> int:
        return self.kv_cache_manager.num_blocks * self.kv_cache_manager.block_size

    @property
    def requests(self) -> Mapping[str, RequestState]:
        """The live requests by id (read only: add_request and abort change them)."""
        return self.output_processor.requests

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    images: list[ImageInput] | None = None, asked_at: float | None = None) -> str:
        """`images`: where a vision model's image embeddings go in the prompt (models/vision/prompt.py
        places them). `asked_at`: when the caller asked, on kv_holds.clock (default now): a resume's
        round learns its tools' time from it."""
        params = params or SamplingParams()
        if params.resume_of:
            self.kv_holds.resume_asked(params.resume_of, self.kv_holds.clock() if asked_at is None else asked_at)
        token_ids = self.encode_prompt(prompt)
        if images:
            self._check_images(token_ids, images)
        if not token_ids:
            raise InvalidRequest("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(token_ids)} tokens; the context window is "
                                 f"{self.max_model_len} tokens, and the answer needs room too")
        need = min(len(token_ids) + params.max_tokens, self.max_model_len)
        window = self.kv_cache_manager.window
        if window is not None:  # the prompt's blocks at admission, then about a window's
            need = min(need, max(len(token_ids) + 1, window_tokens(window, need, self.config.block_size)))
        if need > self.pool_tokens:
            raise InvalidRequest(f"the request needs up to {need} tokens of KV cache; the pool holds "
                                 f"{self.pool_tokens}")
        vocab = self.loaded.config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise InvalidRequest("prompt token ids must be within the vocabulary")
        if any(t < 0 or t >= vocab for t in params.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be within the vocabulary")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.output_processor.requests or request_id in self._groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, priority, images)
        if params.constraint is not None:
            self._add_matcher(seq)
        self.output_processor.add(seq)
        self.scheduler.add(seq)
        if params.n > 1:
            self._groups[request_id] = [seq]
        return request_id

    def _add_matcher(self, seq: Sequence) -> None:
        # The budget the grammar must finish in; without EOS ending the answer there is none to steer by.
        p = seq.params
        budget = None if p.ignore_eos else min(p.max_tokens, self.max_model_len - seq.prompt_len)
        self.guide.add(seq.request_id, p.constraint, budget)

    def _check_images(self, token_ids: list[int], images: list[ImageInput]) -> None:
        vision = self.loaded.vision
        if vision is None:
            raise InvalidRequest(f"model {self.loaded.id} does not take images")
        image_token = vision.image_token_id
        for image in images:
            if not image.positions or any(not 0 <= p < len(token_ids) or token_ids[p] != image_token
                                          for p in image.positions):
                raise InvalidRequest("an image's positions are not the prompt's image tokens")
        if sum(i.num_tokens for i in images) != sum(1 for t in token_ids if t == image_token):
            raise InvalidRequest("the prompt's image tokens and its images' do not match")

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its choices) now; its blocks are free when this returns."""
        ids = [s.request_id for s in self._groups.get(request_id, ())] or [request_id]
        states = [st for i in ids if (st := self.output_processor.requests.get(i)) is not None]
        for state in states:
            self._finish(state, "abort")
        released = self.kv_holds.release(request_id)  # a round kept while its tools run
        return bool(states) or released

    # -- the KV cache during a tool call (kv_holds.py) -----------------------------------
    def hold_kv(self, request_id: str, tools: list[str], policy: str, timeout_s: float,
                asked_at: float | None = None) -> str:
        """The finished round `request_id` (asked with keep_kv) ended in calls to `tools`: hold or evict its
        blocks as `policy` says; "hold", "evict" or "gone" (nothing was kept). `asked_at`: when the caller
        asked, on kv_holds.clock (default now)."""
        return self.kv_holds.decide(request_id, tools, policy, timeout_s, self.scheduler.waiting, asked_at)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks kept for the round `request_id` now (no resume is coming)."""
        return self.kv_holds.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self.output_processor.has_finished_outputs()

    def hold_background(self, held: bool) -> None:
        """While held, background sequences (priority at or above background_priority) sit out every step:
        the server holds them while a foreground request is on its way in, so that it does not wait for a
        step of them that began meanwhile. No effect without a background_priority."""
        self.scheduler.background_held = held

    def interrupt_background(self) -> None:
        """Stop a step of background sequences alone (ScheduledBatch.interruptible) at its next layer
        boundary, the one running or the next to start before clear_background_interrupt(): foreground
        work then waits for one layer rather than the whole step. The step is planned again later.
        Safe from any thread; only the native decode path stops (others finish their step)."""
        interrupt = getattr(self.runner.model, "interrupt_decode", None)
        if interrupt is not None and self.config.background_interrupt:
            interrupt()

    def clear_background_interrupt(self) -> None:
        """Withdraw an interrupt_background() that no step has taken (at a step boundary)."""
        clear = getattr(self.runner.model, "clear_decode_interrupt", None)
        if clear is not None:
            clear()

    def only_held_work(self) -> bool:
        """Whether a step now would run nothing: all that is queued is background work that is held."""
        return self.scheduler.only_held_work() and not self.output_processor.has_finished_outputs()

    # -- stepping -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, execute, update. Returns this step's outputs."""
        outputs = self.output_processor.take_finished()
        self.kv_holds.expire()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        scheduled = batch.decodes + [s for s, _ in batch.prefills]
        self.output_processor.mark_scheduled(scheduled, time.time())
        for seq in plan_forks(batch):
            self._plan_forks(seq)
        runner = self.runner
        encoder_s, encoder_work, t0 = runner.encoder_seconds, runner.encoder_work, time.perf_counter()
        result = self.executor.execute(batch)
        if result.interrupted:  # foreground work came in: these sequences run the step again later
            self.stats.interrupted += 1
            self.stats.record_step_time(time.perf_counter() - t0, batch.background_only, interrupted=True)
            return outputs
        if self.scheduler.encoder is not None:
            self.encoder_pacer.record(self.scheduler.encoder.shared, time.perf_counter() - t0,
                                      runner.encoder_seconds - encoder_s, runner.encoder_work - encoder_work)
        self._update(batch, scheduled, result, outputs)
        self.stats.record_step_time(time.perf_counter() - t0, batch.background_only, interrupted=False)
        return outputs

    def _update(self, batch: ScheduledBatch, scheduled: list[Sequence], result: ModelOutput,
                outputs: list[RequestOutput]) -> None:
        """Apply one step's ModelOutput to its sequences, appending their outputs to `outputs`."""
        # A failure is attributed to the sequences it belongs to; the rest of the batch carries on.
        outputs += [o for seq, exc in result.forward_failed.items()
                    if (o := self._fail(seq, f"the forward pass failed: {exc!r}"))]
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            if seq.images and self.scheduler.encoder is not None:
                self.scheduler.encoder.consumed(seq)  # the image pieces it has read leave their pins
        for seq, found in result.prompt_logprobs.items():
            seq.prompt_logprobs.extend(found)
        for seq in scheduled:
            if seq.forks:
                self._attach_forks(seq)
        now = time.time()
        num_new = 0
        failures = result.failures
        for row, (seq, tokens) in enumerate(zip(result.sampled, result.new_tokens)):
            if row in failures:  # this row alone could not be sampled
                out = self._fail(seq, f"sampling failed: {failures[row]}")
                if out is not None:
                    outputs.append(out)
                continue
            # Kept proposals are computed already: their K/V went in with this step's forward.
            seq.num_computed_tokens += len(tokens) - 1
            had_proposals = bool(seq.spec_token_ids)
            seq.spec_token_ids = []
            appended, out = self._append_tokens(seq, tokens, now, result.logprobs.get(row))
            num_new += appended
            if out is not None:
                outputs.append(out)
            if had_proposals:
                if not seq.is_finished:
                    # Roll back the blocks that only held rejected proposals.
                    self.kv_cache_manager.trim(seq, len(seq))
                self.spec.verified(seq, appended)
        for seq in scheduled:
            if not seq.is_finished:
                self.kv_cache_manager.register_full_blocks(seq)
                self.kv_cache_manager.release_behind_window(seq)
        self.stats.record_step(batch.num_tokens, num_new, now)

    def _plan_forks(self, seq: Sequence) -> None:
        """Make the other choices of `seq`, whose prompt this step completes (choices.py)."""
        seq.forks = [seq.fork(i) for i in range(1, seq.params.n)]
        for fork in seq.forks:
            if seq.params.constraint is not None:
                self._add_matcher(fork)
            self._groups[seq.group_id].append(fork)

    def _attach_forks(self, seq: Sequence) -> None:
        """After the forward: each fork takes the prompt's blocks and runs, or (no room) waits to compute them."""
        for fork in seq.forks:
            self.output_processor.add(fork)
            if (len(self.scheduler.running) < self.scheduler.config.max_num_seqs
                    and self.kv_cache_manager.fork(seq, fork)):
                fork.status = SequenceStatus.RUNNING
                self.scheduler.running.append(fork)
            else:
                self.scheduler.add(fork)
        seq.forks = []

    def _append_tokens(self, seq: Sequence, tokens: list[int], now: float,
                       logprobs: list[TokenLogprob] | None = None) -> tuple[int, RequestOutput | None]:
        """Append `tokens` to `seq` until one ends it: how many went in, and one output for them all
        (with the tokens' logprobs where given, the end token that finishes it left out)."""
        state = self.output_processor.requests[seq.request_id]
        process, guide = self.output_processor.process_token, self.guide
        merged: RequestOutput | None = None
        appended = 0
        for token in tokens:
            seq.token_ids.append(token)
            guide.advance(seq.request_id, token)
            appended += 1
            try:
                reason = process(state, token, now)
                out = self.output_processor.delta(state, token) if reason is None else \
                    self._finish(state, reason, emit=False)
            except Exception as exc:  # detokenizing or stop matching: this request's problem alone
                return appended, self._fail(seq, f"decoding the output failed: {exc!r}")
            if logprobs is not None:
                out.logprobs = [] if reason == "stop" and not state.stopped_by_string else [logprobs[appended - 1]]
            if seq.prompt_logprobs is not None and seq.num_output_tokens == 1:
                out.prompt_logprobs = list(seq.prompt_logprobs)
            merged = out if merged is None else merge_outputs(merged, out)
            if seq.is_finished:
                break
        return appended, merged

    def _fail(self, seq: Sequence, message: str) -> RequestOutput | None:
        """Finish one request with finish_reason 'error'; its blocks are freed, nothing else is touched."""
        state = self.output_processor.requests.get(seq.request_id)
        if state is None:  # already finished (aborted meanwhile)
            return None
        log.warning("request %s failed: %s", seq.request_id, message)
        self.stats.failed += 1
        out = self._finish(state, "error", emit=False)
        out.error = message
        return out

    def _finish(self, state: RequestState, reason: str, emit: bool = True) -> RequestOutput:
        """End a request: free its blocks, matcher and proposer state, and make its final output."""
        seq = state.seq
        if reason in ("stop", "length") and seq.params.keep_kv and seq.params.n == 1:
            self.kv_holds.keep(seq)  # its blocks wait for the caller's decision; remove() frees what is left
        self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.forget(seq)
        self.guide.remove(seq.request_id)
        group = self._groups.get(seq.group_id, [])
        for fork in seq.forks:  # made for a step whose forward failed: they never ran
            self.guide.remove(fork.request_id)
            group.remove(fork)
        seq.forks = []
        seq.status = SequenceStatus.FINISHED
        if group and all(s.is_finished for s in group):
            del self._groups[seq.group_id]
        if reason == "abort":
            self.stats.aborted += 1
        return self.output_processor.finish(state, reason, emit)

    # -- offline use --------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; the final outputs in prompt order, a
        request of n choices giving n of them (by index)."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [(self.add_request(p, sp), sp.n) for p, sp in zip(prompts, plist)]
        keys = [(request_id, i) for request_id, n in ids for i in range(n)]
        results: dict[tuple[str, int], RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(keys), desc="generating", unit="req", leave=False)
        while len(results) < len(keys):
            for out in self.step():
                if out.finished:
                    results[(out.request_id, out.index)] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [results[k] for k in keys]

    def embed(self, prompts: list[str | list[int]], pooling: str = "last") -> list[list[float]]:
        """Each prompt's pooled, L2-normalized final hidden state (offline use; see embedding.py)."""
        return self.embedder.run([self.encode_prompt(p) for p in prompts], pooling)

    def snapshot(self) -> EngineSnapshot:
        kv, st = self.kv_cache_manager, self.stats
        return EngineSnapshot(
            num_requests_running=len(self.scheduler.running), num_requests_waiting=len(self.scheduler.waiting),
            num_waiting_tokens=sum(len(s) - s.num_computed_tokens for s in list(self.scheduler.waiting)),
            kv_cache_usage_perc=kv.usage, kv_cache_blocks=kv.num_blocks, kv_cache_free_blocks=kv.num_free_blocks,
            block_size=kv.block_size, prefix_cache_queries=kv.query_tokens, prefix_cache_hits=kv.hit_tokens,
            prefix_cache_hit_rate=kv.hit_rate, prefix_cache_evictions=kv.evictions,
            num_preemptions=self.scheduler.num_preemptions, steps=st.steps, generated_tokens=st.generated_tokens,
            aborted_requests=st.aborted, generation_tokens_per_s=round(st.tokens_per_s(), 2),
            failed_requests=st.failed, interrupted_steps=st.interrupted, step_seconds=st.step_seconds(),
            kv_holds=self.kv_holds.snapshot(),
            spec_decode=dataclasses.replace(self.spec.stats) if self.spec is not None else None)

    def get_stats(self) -> dict:
        """The snapshot as a plain dict (for printing and JSON)."""
        return self.snapshot().as_dict()
