"""Continuing an answer elsewhere: the prompt plus the tokens produced so far becomes the new prompt.

The router uses this when a replica dies mid-answer; a gateway taking over a dead gateway's job can
use the same thing with the tokens it logged. What it takes care of:
- the budget: the continuation asks for what is left of max_tokens (and of min_tokens), and an
  answer the dead replica had already finished (its budget spent, or an end-of-sequence token) ends
  here without another request;
- the text: until the first failover the replica's own text deltas are passed on. After it, with a
  local tokenizer, the text is decoded here from all the answer's token ids, with the engine's own
  incremental detokenizer, so it is exactly what one uninterrupted run would have shown: text the
  dead replica held back (half a UTF-8 character, a possible stop-string start) is not lost, nothing
  is repeated, and a stop string that spans the failover point is still found. Without a tokenizer
  (a vLLM model the gateway has no tokenizer for) the new replica's text is appended as it comes.
"""
from __future__ import annotations

import dataclasses
import logging

from chatloom.engine.detokenizer import IncrementalDetokenizer
from chatloom.engine.sampling_params import SamplingParams
from chatloom.serving.backend import Delta, Timings

log = logging.getLogger(__name__)


class AnswerProgress:
    """One answer's tokens and the text the user has seen, across any number of replicas."""

    def __init__(self, params: SamplingParams, tokenizer=None) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.emitted = ""  # text the user has been sent
        self.failovers = 0
        self.stopped = False  # a stop string was found here (after a failover)
        self._detok: IncrementalDetokenizer | None = None
        self._eos = set(getattr(tokenizer, "eos_token_ids", None) or []) | set(params.stop_token_ids)
        self._max_stop = max((len(s) for s in params.stop), default=0)

    @classmethod
    def resumed(cls, params: SamplingParams, tokenizer, token_ids: list[int], sent_text: str) -> "AnswerProgress":
        """An answer begun elsewhere: its token ids and the text its user already has."""
        answer = cls(params, tokenizer)
        answer.token_ids = list(token_ids)
        answer.emitted = sent_text
        answer.failed_over()
        return answer

    # -- budget --------------------------------------------------------------------------
    def _ended_by_eos(self) -> bool:
        return (bool(self.token_ids) and self.token_ids[-1] in self._eos and not self.params.ignore_eos
                and len(self.token_ids) >= self.params.min_tokens)

    def remaining_params(self) -> SamplingParams | None:
        """Sampling parameters for the rest of the answer; None when nothing is left to generate."""
        left = self.params.max_tokens - len(self.token_ids)
        if left <= 0 or self._ended_by_eos():
            return None
        return dataclasses.replace(self.params, max_tokens=left,
                                   min_tokens=max(0, self.params.min_tokens - len(self.token_ids)))

    def natural_finish(self) -> str:
        return "stop" if self._ended_by_eos() else "length"

    # -- text -----------------------------------------------------------------------------
    def failed_over(self) -> None:
        """The replica died; from now on decode the text here (when a tokenizer is at hand)."""
        self.failovers += 1
        if self.tokenizer is not None and self._detok is None:
            self._detok = IncrementalDetokenizer(self.tokenizer)
            for t in self.token_ids:
                self._detok.add(t)

    def add(self, token_ids: list[int], text: str, final: bool) -> str:
        """Record a streamed piece; the text to send the user for it."""
        self.token_ids += token_ids
        if self._detok is None:
            self.emitted += text
            return text
        for t in token_ids:
            self._detok.add(t)
        full = self._detok.text
        if self._max_stop:
            start = max(0, len(self.emitted) - self._max_stop)
            hits = [i for i in (full.find(s, start) for s in self.params.stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._emit_to(full[:min(hits)])
        if final:
            self._detok.flush()
            return self._emit_to(self._detok.text)
        # Hold back what might be the start of a stop string, as the engine does.
        safe = len(full) - (self._max_stop - 1 if self._max_stop else 0)
        return self._emit_to(full[:max(safe, len(self.emitted))])

    def _emit_to(self, target: str) -> str:
        if not target.startswith(self.emitted):  # should not happen: the replica decoded the same tokens
            log.warning("continued text does not extend the text already sent; appending the difference")
            common = len(self.emitted)
            delta = target[common:]
        else:
            delta = target[len(self.emitted):]
        self.emitted += delta
        return delta

    def finish(self, reason: str, prompt_tokens: int, cached_tokens: int, metrics: Timings | None,
               text: str = "") -> Delta:
        """The last delta: counts are what was really generated, on every replica together."""
        return Delta(text, True, reason, prompt_tokens, len(self.token_ids), cached_tokens, metrics,
                     failovers=self.failovers)
