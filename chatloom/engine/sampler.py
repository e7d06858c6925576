"""Pick the next token of each sequence from its logits.

Numerically safe for every value SamplingParams accepts: temperatures and nucleus sizes below
their floors are greedy, the arithmetic is float32 with the top token always kept, and a row that
still cannot be sampled (the model produced NaN logits, say) fails only its own request: the
failure is reported per row, never raised for the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from chatloom.engine.sampling_params import TEMPERATURE_FLOOR
from chatloom.engine.sequence import Sequence


class SamplingError(RuntimeError):
    """One sequence's token could not be drawn; the message says why."""

    @classmethod
    def nan_logits(cls) -> "SamplingError":
        """The failure of a sequence whose logits hold a NaN where its token would come from."""
        return cls("the model produced NaN logits for this sequence")


@dataclass(frozen=True)
class GreedyPicks:
    """Each row's argmax as Python ints, and the rows whose maximum is a NaN, as the native decode
    step returns them: greedy rows then take their token without a tensor call (each costs tens of
    microseconds on the caches a decode step's weights have just flushed)."""
    tokens: list[int]
    nan_rows: list[int]


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside each row's top-k and top-p nucleus. logits: [N, V] float32."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p. The first token always stays, even when
    # top_p rounds to 0 in float32 or the row's probabilities are not finite.
    cum_before = probs.cumsum(dim=-1) - probs
    drop |= cum_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def draw_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` [vocab] by inverse CDF of a single uniform draw. One draw
    per token keeps a seeded request's stream aligned however its tokens are produced
    (speculative decoding checks proposals against this same draw)."""
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int],
                 argmax: torch.Tensor | None = None) -> list[int]:
        """logits: [N, vocab]; argmax: their row-wise argmax when the caller has it already.
        Raises SamplingError if any row fails (use sample() to keep the other rows)."""
        tokens, failures = self.sample(logits, seqs, eos_ids, argmax)
        if failures:
            raise next(iter(failures.values()))
        return tokens  # type: ignore[return-value]

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int],
               argmax: torch.Tensor | None = None, picks: GreedyPicks | None = None
               ) -> tuple[list[int | None], dict[int, SamplingError]]:
        """Each row's token (None where it failed) and the failures by row. `picks`: argmax and its
        NaN rows as ints, when the forward made them (the same values as `argmax`)."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        failures: dict[int, SamplingError] = {}
        # min_tokens: end-of-sequence tokens are not allowed yet.
        banned_any = False
        for row, seq in enumerate(seqs):
            p = seq.params
            if seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
                if banned:
                    if not banned_any and logits.is_inference():
                        # The forward ran in inference mode, whose tensors refuse in-place writes here.
                        logits = logits.clone()
                    try:
                        logits[row, banned] = float("-inf")
                    except (IndexError, RuntimeError) as exc:
                        failures[row] = SamplingError(f"cannot ban stop tokens {banned}: {exc}")
                    banned_any = True
        # A row with NaN logits has no meaningful token, greedy or not. argmax ranks NaN above every
        # number, so such a row's argmax points at a NaN: one look per row instead of a vocabulary pass.
        if picks is not None and not banned_any:
            out: list[int | None] = list(picks.tokens)
            nan_rows = picks.nan_rows
        else:
            if argmax is None or banned_any:
                argmax = logits.argmax(dim=-1)
            picked = logits.gather(1, argmax.unsqueeze(1)).tolist()  # few tensor calls: see ModelRunner.execute
            nan_rows = [row for row, (value,) in enumerate(picked) if value != value]
            out = argmax.tolist()
        for row in nan_rows:
            if row not in failures:
                failures[row] = SamplingError.nan_logits()
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy and i not in failures]
        if rows:
            self._draw(logits, seqs, rows, out, failures)
        for row in failures:
            out[row] = None
        return out, failures

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], out: list[int | None],
              failures: dict[int, SamplingError]) -> None:
        sub = logits[rows]
        # The floor keeps the division finite; params below it are greedy and never get here.
        temps = torch.tensor([max(seqs[i].params.temperature, TEMPERATURE_FLOOR) for i in rows],
                             dtype=torch.float32)
        sub = sub / temps.unsqueeze(1)
        top_k = torch.tensor([seqs[i].params.top_k for i in rows])
        top_p = torch.tensor([seqs[i].params.top_p for i in rows], dtype=torch.float32)
        if bool((top_k > 0).any() or (top_p < 1).any()):
            sub = _filter_top_k_top_p(sub, top_k, top_p)
        # Logits of +inf (an overflow) would make softmax NaN: such a row takes its top token.
        overflow = torch.isposinf(sub).any(dim=-1).tolist()
        probs = sub.softmax(dim=-1)
        for j, i in enumerate(rows):
            if overflow[j]:
                out[i] = int(sub[j].argmax())
                continue
            # A seeded request draws from its own generator: same seed, same text, whatever the batch.
            gen = seqs[i].generator or self.generator
            row = probs[j]
            if not bool(torch.isfinite(row).all()) or float(row.sum()) <= 0:  # every token banned, or worse
                failures[i] = SamplingError("no token can be sampled: the probabilities are not finite")
                continue
            out[i] = draw_token(row, gen)
