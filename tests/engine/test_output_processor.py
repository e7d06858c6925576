"""Output processing: text deltas, stop strings held back and cut, finish reasons, request metrics."""
from __future__ import annotations

from chatloom.engine.output_processor import OutputProcessor, merge_outputs
from chatloom.engine.sampling_params import SamplingParams
from chatloom.engine.sequence import Sequence

EOS = 0


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i != EOS)


def _feed(proc: OutputProcessor, seq: Sequence, text: str, now: float = 1.0):
    """Append the characters of `text` as tokens until one finishes; the outputs and the finish reason."""
    state = proc.requests[seq.request_id]
    outs = []
    for ch in text:
        seq.token_ids.append(ord(ch))
        reason = proc.process_token(state, ord(ch), now)
        if reason is not None:
            return outs, reason
        outs.append(proc.delta(state, ord(ch)))
    return outs, None


def _processor(params: SamplingParams, max_model_len: int = 100) -> tuple[OutputProcessor, Sequence]:
    proc = OutputProcessor(CharTokenizer(), [EOS], max_model_len)
    seq = Sequence("r", [ord("p")], params)
    proc.add(seq)
    return proc, seq


def test_text_that_may_start_a_stop_string_is_held_back_and_the_stop_cut():
    proc, seq = _processor(SamplingParams(max_tokens=20, stop=["END"]))
    outs, reason = _feed(proc, seq, "abEN")
    # "EN" could start "END": only "ab" is shown so far (the hold-back is len(stop) - 1 characters).
    assert "".join(o.delta_text for o in outs) == "ab" and outs[-1].text == "ab"
    outs, reason = _feed(proc, seq, "D!")
    assert reason == "stop" and outs == []
    final = proc.finish(proc.requests["r"], reason, emit=False)
    assert final.finished and final.text == "ab" and final.delta_text == "" and final.finish_reason == "stop"
    assert "r" not in proc.requests


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop():
    proc, seq = _processor(SamplingParams(max_tokens=20, stop=["END"]))
    outs, _ = _feed(proc, seq, "ENx")
    # The last len("END") - 1 characters are held back at every token: they could begin a stop string.
    assert "".join(o.delta_text for o in outs) == "E"
    final = proc.finish(proc.requests["r"], "length", emit=True)
    assert final.text == "ENx" and final.delta_text == "Nx"
    assert proc.has_finished_outputs() and proc.take_finished() == [final] and not proc.has_finished_outputs()


def test_finish_reasons_stop_token_min_tokens_and_length():
    proc, seq = _processor(SamplingParams(max_tokens=5, min_tokens=2))
    state = proc.requests["r"]
    seq.token_ids.append(EOS)
    assert proc.process_token(state, EOS, 1.0) is None  # before min_tokens an end token is no stop
    seq.token_ids.append(EOS)
    assert proc.process_token(state, EOS, 2.0) == "stop"
    ignoring, seq = _processor(SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[ord("q")]))
    outs, reason = _feed(ignoring, seq, "\x00q")
    assert reason == "stop" and len(outs) == 1  # EOS ignored; a stop token still stops
    proc2, seq2 = _processor(SamplingParams(max_tokens=2))
    outs, reason = _feed(proc2, seq2, "xyz")
    assert reason == "length" and len(outs) == 1
    proc3, seq3 = _processor(SamplingParams(max_tokens=50), max_model_len=4)
    outs, reason = _feed(proc3, seq3, "abcdef")
    assert reason == "length" and len(seq3) == 4  # the context window ends it


def test_request_metrics_follow_the_tokens():
    proc, seq = _processor(SamplingParams(max_tokens=10))
    _feed(proc, seq, "a", now=5.0)
    _feed(proc, seq, "b", now=7.0)
    m = seq.metrics
    assert (m.first_token_time, m.last_token_time, m.num_output_tokens) == (5.0, 7.0, 2)
    OutputProcessor.mark_scheduled([seq], 3.0)
    OutputProcessor.mark_scheduled([seq], 4.0)
    assert m.first_scheduled_time == 3.0


def test_merged_outputs_carry_every_token_of_a_step():
    proc, seq = _processor(SamplingParams(max_tokens=10))
    outs, _ = _feed(proc, seq, "abc")
    merged = merge_outputs(merge_outputs(outs[0], outs[1]), outs[2])
    assert merged.delta_text == "abc" and merged.delta_token_ids == [ord("a"), ord("b"), ord("c")]
