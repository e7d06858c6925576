"""The last stage of a step, for each new token: its text, whether it ends the request, and the output.

The processor keeps each live request's text state beside its Sequence: the incremental detokenizer,
how much text has been handed out, and whether a stop string cut it. For each token it records the
request's timing metrics, turns the token into text, checks the finish conditions (a stop token
past min_tokens, a stop string, max_tokens, the context window) and builds the RequestOutput with
the text that is safe to show: text that could still become a stop string is held back until the
next token decides. The engine frees a finished request's resources; the processor then builds its
final output and forgets it. Outputs of requests finished between steps (aborts) wait in a queue
for the next step.
"""
from __future__ import annotations

import time
from collections import deque

from chatloom.engine.detokenizer import IncrementalDetokenizer
from chatloom.engine.outputs import RequestOutput
from chatloom.engine.sequence import Sequence
from chatloom.models.tokenizer import TextTokenizer


class RequestState:
    """Per-request text state the engine keeps beside the Sequence."""

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer) -> None:
        self.seq = seq
        self.detok = detok
        self.emitted = 0  # characters of detok.text already handed out
        self.max_stop_len = max((len(s) for s in seq.params.stop), default=0)
        self.stopped_by_string = False
        self.stop_str: str | None = None  # the stop string that ended the request


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output for several tokens of a request in one step (speculative decoding)."""
    then.delta_text = first.delta_text + then.delta_text
    then.delta_token_ids = first.delta_token_ids + then.delta_token_ids
    if first.logprobs is not None or then.logprobs is not None:
        then.logprobs = (first.logprobs or []) + (then.logprobs or [])
    then.prompt_logprobs = then.prompt_logprobs or first.prompt_logprobs
    return then


class OutputProcessor:
    def __init__(self, tokenizer: TextTokenizer, eos_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}  # live requests by id
        self._finished: deque[RequestOutput] = deque()  # final outputs made between steps

    # -- requests ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = RequestState(seq, IncrementalDetokenizer(self.tokenizer))

    def has_finished_outputs(self) -> bool:
        return bool(self._finished)

    def take_finished(self) -> list[RequestOutput]:
        """The final outputs of requests finished since the last step (aborts), now handed out."""
        outputs = list(self._finished)
        self._finished.clear()
        return outputs

    @staticmethod
    def mark_scheduled(seqs: list[Sequence], now: float) -> None:
        for seq in seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now

    # -- one token ----------------------------------------------------------------------
    def process_token(self, state: RequestState, token: int, now: float) -> str | None:
        """Account for `token`, just appended to the sequence: metrics, text, stop checks. Returns the
        finish reason ("stop" or "length") if it ends the request, else None (then `delta` gives the output)."""
        seq, p = state.seq, state.seq.params
        m = seq.metrics
        m.num_output_tokens = seq.num_output_tokens
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        is_eos = token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)
        if is_eos and seq.num_output_tokens >= p.min_tokens:
            return "stop"
        state.detok.add(token)
        if p.stop and seq.num_output_tokens >= p.min_tokens:
            text = state.detok.text
            window_start = max(0, state.emitted - state.max_stop_len)
            hits = [(i, s) for s in p.stop if (i := text.find(s, window_start)) >= 0]
            if hits:
                at, state.stop_str = min(hits, key=lambda hit: hit[0])
                state.detok.text = text[:at]
                state.stopped_by_string = True
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def delta(state: RequestState, token: int) -> RequestOutput:
        """The output for a token that did not end its request: the text now safe to show."""
        seq = state.seq
        # Hold back text that might be the start of a stop string.
        safe = len(state.detok.text) - (state.max_stop_len - 1 if state.max_stop_len else 0)
        if safe <= state.emitted:
            return RequestOutput(seq.group_id, "", [token], state.detok.text[:state.emitted],
                                 num_prompt_tokens=seq.prompt_len, num_output_tokens=seq.num_output_tokens,
                                 index=seq.index)
        delta = state.detok.text[state.emitted:safe]
        state.emitted = safe
        return RequestOutput(seq.group_id, delta, [token], state.detok.text[:safe],
                             num_prompt_tokens=seq.prompt_len, num_output_tokens=seq.num_output_tokens,
                             index=seq.index)

    # -- the end -------------------------------------------------------------------------
    def finish(self, state: RequestState, reason: str, emit: bool) -> RequestOutput:
        """The request's final output (with `emit`, queued for the next step too); it is forgotten.
        The engine has already taken the sequence out of the scheduler."""
        seq = state.seq
        seq.finish_reason = reason
        seq.metrics.finished_time = time.time()
        del self.requests[seq.request_id]
        if not state.stopped_by_string and reason != "error":
            state.detok.flush()
        text = state.detok.text
        delta = text[state.emitted:]
        state.emitted = len(text)
        out = RequestOutput(seq.group_id, delta, [], text, finished=True, finish_reason=reason,
                            num_prompt_tokens=seq.prompt_len, num_output_tokens=seq.num_output_tokens,
                            num_cached_tokens=seq.metrics.num_cached_tokens, metrics=seq.metrics,
                            token_ids=seq.output_token_ids, stop_str=state.stop_str, index=seq.index)
        if emit:
            self._finished.append(out)
        return out
