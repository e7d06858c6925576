"""The chaos run's "traffic kept flowing" check: a run whose clients stop getting replies outside the
faults' windows fails, whatever the fleet's own health checks said."""
from __future__ import annotations

from chatloom.bench.chaos.invariants import traffic_flowed
from chatloom.bench.chaos.ledger import Fault, Ledger


def _ledger(no_reply_outside: int) -> Ledger:
    ledger = Ledger(faults=[Fault("gateway_kill", "gateway2", start=100.0, end=110.0, ready=111.0)])
    for i in range(200):  # a reply every second, 0..199 s
        ledger.reply(float(i), "gateway1", "openai", 200)
    for t in range(100, 121):  # the killed gateway refuses connections until 10 s after it was ready
        ledger.no_reply(t + 0.5, "gateway2", "messages", ConnectionRefusedError())
    for i in range(no_reply_outside):
        ledger.no_reply(130.0 + i * 0.1, "gateway2", "messages", ConnectionResetError())
    return ledger


def test_no_replies_inside_a_fault_window_are_allowed():
    check = traffic_flowed(_ledger(0))
    assert check.ok, check.figures
    assert check.figures["no_reply"] == 21 and check.figures["answered_outside"] == 1.0


def test_a_client_that_stopped_getting_replies_fails_the_run():
    check = traffic_flowed(_ledger(10))  # 10 of the 188 requests outside the window: 94.7% answered
    assert not check.ok
    assert check.figures["answered_outside"] < 0.98 and len(check.failures) == 10
