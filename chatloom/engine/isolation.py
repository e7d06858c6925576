"""Run a batch's forward pass so that one request's failure stays that request's.

When the whole batch's forward raises, the cause is usually one sequence (a token id the model
cannot embed, a kernel bug on one shape). Each sequence is then run again on its own: the ones
that pass produce their logits as if nothing happened (their K/V slots are simply written again),
and only the ones that fail alone are reported as failed. A retry costs one forward per sequence,
paid only on the rare step that fails.
"""
from __future__ import annotations

import logging

import torch

from chatloom.engine.model_runner import ForwardResult, ModelRunner
from chatloom.engine.scheduler import ScheduledBatch
from chatloom.engine.sequence import Sequence

log = logging.getLogger(__name__)


def split_batch(batch: ScheduledBatch) -> list[ScheduledBatch]:
    """One batch per sequence, each with exactly its share of the original. A prefill alone encodes
    the image pieces it reads itself; a slice of encoder work for a sequence that reads nothing this
    step is a part of its own."""
    reading = set(batch.decodes) | {s for s, _ in batch.prefills}
    return ([ScheduledBatch(decodes=[s]) for s in batch.decodes]
            + [ScheduledBatch(prefills=[(s, n)]) for s, n in batch.prefills]
            + [ScheduledBatch(encode=[p]) for p in batch.encode if p.seq is not None and p.seq not in reading])


def _owner(part: ScheduledBatch) -> Sequence:
    return (part.decodes or [s for s, _ in part.prefills] or [p.seq for p in part.encode])[0]


def execute_isolated(runner: ModelRunner, batch: ScheduledBatch) -> ForwardResult:
    """The batch's forward; if it fails, each sequence alone, failing only those that fail alone."""
    try:
        return runner.execute(batch)
    except Exception as exc:
        parts = split_batch(batch)
        if len(parts) == 1:
            return ForwardResult(torch.empty(0), None, [], {_owner(parts[0]): exc})
        if not parts:  # encoder work planned for no sequence: nobody to fail, the pieces run again when read
            log.warning("encoder work failed (%r)", exc)
            return ForwardResult(torch.empty(0), None, [])
        log.warning("a batch of %d sequences failed (%r); running each alone", len(parts), exc)
    logits, argmaxes, sampled, failed, prompt = [], [], [], {}, []
    for part in parts:
        seq = _owner(part)
        try:
            part_result = runner.execute(part)
        except Exception as exc:
            log.warning("request %s fails its forward pass on its own: %r", seq.request_id, exc)
            failed[seq] = exc
            continue
        prompt += part_result.prompt_logits
        if part_result.sampled:
            l, a = part_result.logits, part_result.argmax
            logits.append(l)
            argmaxes.append(a if a is not None else l.argmax(dim=-1))
            sampled.extend(part_result.sampled)
    if not logits:
        return ForwardResult(torch.empty(0), None, [], failed, prompt_logits=prompt)
    return ForwardResult(torch.cat(logits), torch.cat(argmaxes), sampled, failed, prompt_logits=prompt)
