"""Embeddings: a prompt's final hidden states pooled into one unit vector, through the prefill path.

Why the prefill path: an embedding is a prompt's forward pass without the LM head, so it runs as a
prefill does (the same `ModelRunner._prepare`, paged attention and kernels), chunked to the step's
token budget, and takes turns with generation steps in the engine loop instead of stopping it.
Its K/V has to go somewhere while the prompt's later chunks attend to its earlier ones, so each
prompt holds fresh blocks of the pool for as long as its forward passes run, and gives them all back
when its vector is made. They are never published in the prefix cache, and cached blocks are never
read: mean pooling needs every token's hidden state, which a cache hit would skip.

Pooling: "mean" averages every token's final (normed) hidden state, "last" takes the last token's
(what decoder-only embedding models trained with an end token use). Either way the vector is
L2-normalized in float32.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from chatloom.engine.kv_cache_manager import KVCacheManager
from chatloom.engine.model_runner import ModelRunner
from chatloom.engine.sampling_params import InvalidRequest, SamplingParams
from chatloom.engine.scheduler import ScheduledBatch
from chatloom.engine.sequence import Sequence

POOLINGS = ("mean", "last")


@dataclass
class _Prompt:
    seq: Sequence
    total: torch.Tensor | None = None  # the running sum of hidden rows (mean) or the last row (last)


@dataclass
class EmbedJob:
    """Prompts embedded together; `vectors` fills in as each one finishes."""

    job_id: str
    prompts: list[list[int]]
    pooling: str
    vectors: list[list[float] | None] = field(default_factory=list)
    next_prompt: int = 0  # the first prompt not yet given blocks

    @property
    def done(self) -> bool:
        return all(v is not None for v in self.vectors)

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


class Embedder:
    """Runs embedding jobs one forward pass at a time (`step`), within a token budget per pass."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, max_tokens_per_step: int, max_model_len: int,
                 vocab_size: int) -> None:
        self.runner = runner
        self.kv = kv
        self.budget = max_tokens_per_step
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.jobs: list[EmbedJob] = []
        self._active: list[tuple[EmbedJob, int, _Prompt]] = []  # prompts holding blocks, mid-way
        self._ids = itertools.count()

    def check(self, prompts: list[list[int]], pooling: str) -> None:
        """Refuse what could never be embedded (InvalidRequest), before anything is queued."""
        if pooling not in POOLINGS:
            raise InvalidRequest(f"unknown pooling {pooling!r}: use {' or '.join(POOLINGS)}")
        if not prompts:
            raise InvalidRequest("nothing to embed")
        pool_tokens = self.kv.num_blocks * self.kv.block_size
        for i, ids in enumerate(prompts):
            if not ids:
                raise InvalidRequest(f"input {i} is empty")
            limit = min(self.max_model_len, pool_tokens)
            if len(ids) > limit:
                raise InvalidRequest(f"input {i} has {len(ids)} tokens; this model embeds at most {limit}")
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise InvalidRequest(f"input {i} has token ids outside the vocabulary")

    def add(self, prompts: list[list[int]], pooling: str, job_id: str | None = None) -> EmbedJob:
        self.check(prompts, pooling)
        job = EmbedJob(job_id or f"embed-{next(self._ids)}", [list(p) for p in prompts], pooling,
                       [None] * len(prompts))
        self.jobs.append(job)
        return job

    def has_work(self) -> bool:
        return bool(self.jobs)

    def abort(self, job_id: str) -> bool:
        """Drop a job; blocks its prompts hold are freed now."""
        job = next((j for j in self.jobs if j.job_id == job_id), None)
        if job is None:
            return False
        self.jobs.remove(job)
        for entry in [a for a in self._active if a[0] is job]:
            self._active.remove(entry)
            self.kv.free_sequence(entry[2].seq)
        return True

    # -- one forward pass ---------------------------------------------------------------
    def _take_blocks(self) -> None:
        """Give fresh blocks to the next waiting prompts while the pass has budget and the pool has room."""
        planned = sum(len(p.seq) - p.seq.num_computed_tokens for _, _, p in self._active)
        for job in self.jobs:
            while job.next_prompt < len(job.prompts) and planned < self.budget:
                ids = job.prompts[job.next_prompt]
                need = self.kv.blocks_needed(len(ids))
                if need > self.kv.num_free_blocks:
                    return  # wait for generation to give blocks back; keep the order
                seq = Sequence(f"{job.job_id}/{job.next_prompt}", ids, SamplingParams(max_tokens=1))
                for _ in range(need):
                    seq.block_table.append(self.kv.pool.get_new_block().block_id)
                self._active.append((job, job.next_prompt, _Prompt(seq)))
                job.next_prompt += 1
                planned += len(ids)

    def step(self) -> list[EmbedJob]:
        """Run one forward pass over as many prompt tokens as the budget allows; the jobs it finished."""
        self._take_blocks()
        if not self._active:
            return []
        batch = ScheduledBatch()
        left = self.budget
        for _, _, p in self._active:
            if left <= 0:
                break
            n = min(len(p.seq) - p.seq.num_computed_tokens, left)
            batch.prefills.append((p.seq, n))
            left -= n
        ids, positions, attn, _ = self.runner._prepare(batch)
        with torch.inference_mode():
            if self.runner.before_forward is not None:
                self.runner.before_forward()
            hidden = self.runner.model(ids, positions, attn, self.runner.kv_caches)
        finished: list[EmbedJob] = []
        start = 0
        for (seq, n), entry in zip(batch.prefills, list(self._active)):
            job, index, p = entry
            rows = hidden[start:start + n].float()
            start += n
            if job.pooling == "mean":
                part = rows.sum(0)
                p.total = part if p.total is None else p.total + part
            else:
                p.total = rows[-1]
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq):
                vec = p.total / len(seq) if job.pooling == "mean" else p.total
                job.vectors[index] = torch.nn.functional.normalize(vec, dim=0).tolist()
                self._active.remove(entry)
                self.kv.free_sequence(seq)
                if job.done:
                    self.jobs.remove(job)
                    finished.append(job)
        return finished

    def run(self, prompts: list[list[int]], pooling: str) -> list[list[float]]:
        """Embed `prompts` to the end, here and now (offline use: no generation running meanwhile)."""
        job = self.add(prompts, pooling)
        while not job.done:
            self._take_blocks()
            if not self._active:
                self.abort(job.job_id)
                raise InvalidRequest("the KV pool has no room for the prompt to embed")
            self.step()
        return [v for v in job.vectors if v is not None]
