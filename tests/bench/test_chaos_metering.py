"""The chaos run's "metering equals stored answers" check, and what it reports when it fails: whether
the usage rows or the done events disagree with the saved answers, and which answers."""
from __future__ import annotations

from chatloom.bench.chaos.invariants import Stored, metering_matches
from chatloom.bench.chaos.ledger import Answer, Ledger


def _answer(i: int, done_tokens: int) -> Answer:
    a = Answer("ann", "c1", f"m{i}", f"u{i}", "hi", max_tokens=64)
    a.end = {"event": "done", "usage": {"prompt_tokens": 10, "completion_tokens": done_tokens}}
    return a


def _stored(saved_tokens: list[int], metered_completion: int) -> Stored:
    messages = {f"m{i}": {"id": f"m{i}", "role": "assistant", "user_id": "U", "prompt_tokens": 10,
                          "completion_tokens": t, "status": "complete"} for i, t in enumerate(saved_tokens)}
    usage = {"U": {"requests": len(saved_tokens), "prompt_tokens": 10 * len(saved_tokens),
                   "completion_tokens": metered_completion, "cached_tokens": 0}}
    return Stored({"ann": {"id": "U", "tier": "plus"}}, messages, usage, {})


def test_metering_that_equals_every_done_event_passes():
    ledger = Ledger(answers=[_answer(0, 20), _answer(1, 30)])
    check = metering_matches(ledger, _stored([20, 30], 50), {"ann"})
    assert check.ok and check.figures["exact"] == 1


def test_a_done_event_that_reported_fewer_tokens_than_were_saved_is_named():
    ledger = Ledger(answers=[_answer(0, 20), _answer(1, 25)])
    check = metering_matches(ledger, _stored([20, 30], 50), {"ann"})
    assert not check.ok
    (failure,) = check.failures
    assert failure["metered"] == [20, 50] and failure["done_completion"] == 45
    assert failure["saved_completion"] == 50 and failure["metered_requests"] == 2
    assert failure["done_differs_from_saved"] == [
        {"message_id": "m1", "done": 25, "saved": 30, "status": "complete", "connections": 1}]


def test_usage_metered_beyond_the_saved_answers_shows_as_such():
    ledger = Ledger(answers=[_answer(0, 20), _answer(1, 30)])
    check = metering_matches(ledger, _stored([20, 30], 61), {"ann"})
    (failure,) = check.failures
    assert failure["saved_completion"] == 50 and failure["metered"][1] == 61
    assert failure["done_differs_count"] == 0
