"""Several choices for one prompt (SamplingParams.n): the prompt is computed once, then forked.

A request of n choices enters the engine as one sequence. In the step that computes the last chunk of
its prompt, the engine makes n - 1 forks of it (`plan_forks`); the step's logits row of the prompt's
last token is repeated for each fork (`expand_rows`), so every choice draws its own first token from
the same distribution with its own random stream. After the forward, each fork takes the prompt's K/V
without a second prefill (KVCacheManager.fork: the full blocks shared by reference count, the partial
last block copied) and runs on as a sequence of its own, with its own finish. A fork that finds no free
block for its copy, or no free sequence slot, waits instead and computes its prompt again, mostly from
the prefix cache, as a preempted sequence would.
"""
from __future__ import annotations

import torch

from chatloom.engine.sampler import GreedyPicks
from chatloom.engine.scheduler import ScheduledBatch
from chatloom.engine.sequence import Sequence


def plan_forks(batch: ScheduledBatch) -> list[Sequence]:
    """The sequences that produce their first token in this step and asked for several choices."""
    done = [s for s, n in batch.prefills if s.num_computed_tokens + n == len(s)]
    return [s for s in batch.decodes + done
            if s.params.n > 1 and s.index == 0 and s.num_output_tokens == 0 and not s.forks]


def expand_rows(logits: torch.Tensor, argmax: torch.Tensor | None, sampled: list[Sequence],
                picks: GreedyPicks | None
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[Sequence], GreedyPicks | None]:
    """The step's rows with each forking sequence's row repeated once for each of its forks, which follow
    it. Forking sequences never carry proposed tokens (they have produced no token yet), so rows and
    sequences correspond one to one up to the first proposal."""
    rows, out, row = [], [], 0
    for seq in sampled:
        width = 1 + len(seq.spec_token_ids)
        rows.extend(range(row, row + width))
        out.append(seq)
        for fork in seq.forks:
            rows.append(row)
            out.append(fork)
        row += width
    index = torch.tensor(rows, dtype=torch.long)
    logits = logits[index] if logits.dim() == 2 else logits
    argmax = argmax[index] if argmax is not None else None
    if picks is not None:
        nan = set(picks.nan_rows)
        picks = GreedyPicks([picks.tokens[r] for r in rows], [j for j, r in enumerate(rows) if r in nan])
    return logits, argmax, out, picks
