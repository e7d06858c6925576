"""The middle stage of a step: run the plan's forward pass and pick each sequence's new tokens.

One forward over the whole plan (a failure is attributed to the sequences it belongs to: isolation.py),
then the grammar mask (grammar_mask.py), then either plain sampling (sampler.py) or, when some
sequence carries proposed tokens, speculative verification (spec_decode/verify.py). The result is a
typed ModelOutput; nothing about sequences is changed here: the engine's update stage applies it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from chatloom.engine.choices import expand_rows
from chatloom.engine.grammar_mask import apply_grammar_mask
from chatloom.engine.isolation import execute_isolated
from chatloom.engine.logprobs import asking_rows, log_softmax_rows, prompt_entries, sampled_entries
from chatloom.engine.model_runner import ModelRunner
from chatloom.engine.outputs import TokenLogprob
from chatloom.engine.sampler import Sampler, SamplingError
from chatloom.engine.scheduler import ScheduledBatch
from chatloom.engine.sequence import Sequence
from chatloom.engine.spec_decode import SpeculativeDecoder
from chatloom.engine.structured.guide import GrammarGuide


@dataclass
class ModelOutput:
    """What one step computed, for the update stage."""

    sampled: list[Sequence]  # the sequences that produce tokens this step, in logits order
    new_tokens: list[list[int]]  # per sampled sequence: its new tokens (kept proposals, then one more)
    # Index in `sampled` -> why that sequence alone got no token.
    failures: dict[int, SamplingError] = field(default_factory=dict)
    # Sequences whose forward pass failed on their own (they are not in `sampled`).
    forward_failed: dict[Sequence, Exception] = field(default_factory=dict)
    # Index in `sampled` -> its new tokens' log probabilities, for the sequences that ask (logprobs.py).
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    # Prompt tokens' log probabilities newly found this step, for the sequences that ask.
    prompt_logprobs: dict[Sequence, list[TokenLogprob]] = field(default_factory=dict)
    interrupted: bool = False  # the step stopped part-way (ScheduledBatch.interruptible): nothing to apply


class StepExecutor:
    def __init__(self, runner: ModelRunner, sampler: Sampler, guide: GrammarGuide,
                 spec: SpeculativeDecoder | None, eos_ids: list[int]) -> None:
        self.runner = runner
        self.sampler = sampler
        self.guide = guide
        self.spec = spec
        self.eos_ids = eos_ids

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        spec = self.spec
        t0 = time.perf_counter()
        fwd = execute_isolated(self.runner, batch)
        if fwd.interrupted:
            return ModelOutput([], [], interrupted=True)
        logits, argmax, sampled, picks = fwd.logits, fwd.argmax, fwd.sampled, fwd.picks
        if any(s.forks for s in sampled):  # choices forked from a prompt computed this step (choices.py)
            logits, argmax, sampled, picks = expand_rows(logits, argmax, sampled, picks)
        asking = asking_rows(sampled)
        raw = log_softmax_rows(logits, asking)  # before any mask: the model's own distribution
        if apply_grammar_mask(self.guide, logits, sampled):
            argmax = picks = None  # masked rows: the runner's argmax may be a forbidden token
        if spec is not None and not batch.prefills and not batch.encode and not fwd.failed:
            spec.observe_step(batch.num_tokens, time.perf_counter() - t0)
        if spec is not None and any(s.spec_token_ids for s in sampled):
            new_tokens, failures = spec.verify(logits, argmax, sampled, self.sampler, self.eos_ids, picks)
        elif sampled:
            drawn, failures = self.sampler.sample(logits, sampled, self.eos_ids, argmax, picks)
            new_tokens = [[t] for t in drawn]
        else:
            new_tokens, failures = [], {}
        return ModelOutput(sampled, new_tokens, failures, fwd.failed,
                           sampled_entries(raw, asking, sampled, new_tokens, failures),
                           {seq: prompt_entries(seq, start, rows) for seq, start, rows in fwd.prompt_logits})
