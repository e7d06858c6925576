"""The chaos run's "traffic kept flowing" check: a run whose clients stop getting replies outside the
faults' windows fails, whatever the fleet's own health checks said. And its 5xx check: a reply other than
a documented 503 fails the run, naming the gateway and the faults it came in."""
from __future__ import annotations

from chatloom.bench.chaos.invariants import no_unexpected_5xx, traffic_flowed
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


def test_a_500_fails_the_run_and_names_the_faults_around_it():
    ledger = Ledger(faults=[Fault("postgres_restart", "postgres", start=100.0, end=101.0, ready=101.5)])
    ledger.reply(100.5, "gateway1", "messages", 503, {"retry-after": "2"}, {"error": {"code": "database_unavailable"}})
    assert no_unexpected_5xx(ledger).ok
    ledger.reply(101.0, "gateway2", "messages", 500, None, {"error": {"code": "internal_error"}})
    check = no_unexpected_5xx(ledger)
    assert not check.ok
    assert check.failures == [{"route": "messages", "status": 500, "code": "internal_error", "retry_after": None,
                               "in_fault_window": True, "gateway": "gateway2", "faults": ["postgres_restart postgres"]}]
