"""Continuation text: after a failover, the text decoded from all the answer's tokens equals one run's."""
from chatloom.engine.detokenizer import IncrementalDetokenizer
from chatloom.engine.sampling_params import SamplingParams
from chatloom.serving.continuation import AnswerText


def one_run_text(tok, ids):
    d = IncrementalDetokenizer(tok)
    for t in ids:
        d.add(t)
    d.flush()
    return d.text


def test_text_after_failover_has_no_gap_and_no_repeat(tiny_tokenizer):
    ids = tiny_tokenizer.encode("héllo wörld, über alles ✓ and more text")
    want = one_run_text(tiny_tokenizer, ids)
    for cut in range(1, len(ids)):
        a = AnswerText(SamplingParams(max_tokens=100), tiny_tokenizer)
        d = IncrementalDetokenizer(tiny_tokenizer)
        sent = ""
        for t in ids[:cut]:  # what the first replica streamed: its own deltas (held-back bytes unsent)
            before = d.text
            d.add(t)
            sent += a.add([t], d.text[len(before):], False)
        a.failed_over()
        for i, t in enumerate(ids[cut:]):
            sent += a.add([t], "?", cut + i == len(ids) - 1)
        assert sent == want, cut


def test_stop_string_spanning_the_failover_point_is_found(tiny_tokenizer):
    ids = tiny_tokenizer.encode("abc STOP def")
    a = AnswerText(SamplingParams(max_tokens=100, stop=["STOP"]), tiny_tokenizer)
    sent = a.add(ids[:6], "abc", False)  # the first replica held back " ST" (a possible stop start)
    a.failed_over()
    sent += a.add(ids[6:], "OP def", True)
    assert a.stopped and sent == "abc "


def test_remaining_budget_and_a_finished_answer(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_ids[0]
    a = AnswerText(SamplingParams(max_tokens=10, min_tokens=4), tiny_tokenizer)
    a.add([1, 2, 3], "", False)
    rest = a.remaining_params()
    assert rest.max_tokens == 7 and rest.min_tokens == 1
    a.add([4, eos], "", False)
    assert a.remaining_params() is None and a.natural_finish() == "stop"
    b = AnswerText(SamplingParams(max_tokens=2), tiny_tokenizer)
    b.add([1, 2], "", False)
    assert b.remaining_params() is None and b.natural_finish() == "length"
