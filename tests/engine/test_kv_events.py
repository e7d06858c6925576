"""The prefix cache's numbered event log, as a replica publishes it."""
from __future__ import annotations

from chatloom.engine.kv_events import KVEventLog


def test_event_log_gives_a_snapshot_to_a_reader_too_far_behind_or_ahead():
    log = KVEventLog("m", 4, window=3)
    for k in range(5):
        log.stored([k])
    log.removed([0])
    recent = log.since(4)
    assert [e.seq for e in recent.events] == [5, 6] and not recent.reset
    behind = log.since(1)  # events 2.. are no longer all in the window
    assert behind.reset and set(behind.snapshot) == {1, 2, 3, 4} and behind.last_seq == 6
    assert log.since(99).reset  # a reader ahead of the log: the replica restarted
