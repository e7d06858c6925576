"""What a failed chaos run keeps of its processes' logs: the error records with their tracebacks, since
the run's folder (and the logs in it) is removed when the run ends."""
from __future__ import annotations

from pathlib import Path

from chatloom.bench.chaos.report import logged_errors, table

GATEWAY_LOG = """\
2026-12-06 20:01:02,003 WARNING chatloom.app.queue: queue is long
2026-12-06 20:01:03,004 ERROR chatloom.app.api.error_handlers: unhandled error on POST /api/conversations/1/messages
Traceback (most recent call last):
  File "x.py", line 1, in f
KeyError: 'stream'
2026-12-06 20:01:04,005 INFO chatloom.app: fine again
INFO:     127.0.0.1:5000 - "GET /health HTTP/1.1" 200 OK
ERROR:    Exception in ASGI application
Traceback (most recent call last):
ValueError: boom
"""


def test_error_records_come_with_their_tracebacks_and_nothing_else(tmp_path: Path):
    (tmp_path / "gateway1.log").write_text(GATEWAY_LOG)
    (tmp_path / "replica1.log").write_text("2026-12-06 20:01:02,003 INFO chatloom: ready\n")
    errors = logged_errors(tmp_path)
    assert list(errors) == ["gateway1"]
    first, second = errors["gateway1"]
    assert first.startswith("2026-12-06 20:01:03,004 ERROR") and first.endswith("KeyError: 'stream'")
    assert second.startswith("ERROR:    Exception in ASGI application") and second.endswith("ValueError: boom")


def test_a_long_traceback_keeps_its_start_and_the_exception_raised(tmp_path: Path):
    frames = "".join(f'  File "m{i}.py", line {i}, in f\n    call()\n' for i in range(60))
    (tmp_path / "gateway2.log").write_text("2026-12-06 20:01:03,004 ERROR asyncio: Unhandled exception\n"
                                           f"Traceback (most recent call last):\n{frames}"
                                           "anyio.ClosedResourceError: the stream was closed\n")
    (record,) = logged_errors(tmp_path, lines_each=40)["gateway2"]
    lines = record.splitlines()
    assert len(lines) == 40 and lines[0].endswith("Unhandled exception") and lines[1].startswith("Traceback")
    assert lines[-1] == "anyio.ClosedResourceError: the stream was closed" and "lines left out" in lines[10]


def test_only_the_first_few_records_are_kept(tmp_path: Path):
    (tmp_path / "gateway2.log").write_text("".join(f"2026-12-06 20:01:{i:02d},000 ERROR x: failure {i}\n"
                                                   for i in range(20)))
    assert len(logged_errors(tmp_path, per_log=5)["gateway2"]) == 5


def test_the_table_ends_with_the_errors():
    result = {"invariants": [], "faults": [], "fault_counts": {},
              "traffic": {"requests": 0, "replies": 0, "no_reply": 0, "answers": 0,
                          "answers_found_after_lost_reply": 0, "unknown_submissions": 0},
              "log_errors": {"gateway1": ["2026-12-06 20:01:03,004 ERROR x: unhandled"]}}
    assert table(result).endswith("gateway1.log, first errors:\n2026-12-06 20:01:03,004 ERROR x: unhandled")


def test_records_with_a_traceback_come_before_the_expected_errors(tmp_path: Path):
    expected = "".join(f"2026-12-06 20:01:{i:02d},000 ERROR x: database unreachable on POST /v1/x\n" for i in range(9))
    (tmp_path / "gateway1.log").write_text(expected + GATEWAY_LOG)
    errors = logged_errors(tmp_path, per_log=3)["gateway1"]
    assert errors[0].endswith("KeyError: 'stream'") and errors[1].endswith("ValueError: boom")
    assert "database unreachable" in errors[2]
