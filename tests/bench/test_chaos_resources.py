"""The chaos run's descriptor count: live connections are left out, a socket its peer closed is not."""
from __future__ import annotations

import os
import socket
import time

from chatloom.bench.chaos.resources import Sample, SlotSamples, growth, tree_fds


def _wait_for(check, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_connection_closed_by_its_peer_counts_as_held_and_a_live_one_does_not():
    pid = os.getpid()
    before_fds, _, before_live, _ = tree_fds(pid)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        fds, _, live, _ = tree_fds(pid)
        assert fds - before_fds == 3 and live - before_live == 3  # listener and both ends
        accepted.close()  # the peer goes: `client` is now in CLOSE_WAIT, never closed here
        _wait_for(lambda: tree_fds(pid)[2] - before_live == 1)
        fds, _, live, kinds = tree_fds(pid)
        assert kinds.get("tcp:close_wait") == 1
        assert fds - before_fds == 2  # the listener (live) and the leaked end (held)
        assert (fds - live) - (before_fds - before_live) == 1
    finally:
        client.close()
        server.close()
        accepted.close()


def test_growth_is_judged_on_held_descriptors():
    first = [Sample(t, 1, 100 << 20, fds=20 + live, sockets=live, live=live) for t, live in ((1, 10), (2, 12), (3, 11))]
    last = [Sample(t, 1, 100 << 20, fds=20 + live, sockets=live, live=live) for t, live in ((12, 20), (13, 22), (14, 21))]
    row = growth(SlotSamples("gateway1", first + last), t0=0, window_s=16)
    assert row["fds_growth"] == 0.0 and row["all_fds_last"] > row["all_fds_first"]
    leaked = [Sample(s.t, 1, s.rss, s.fds + 3, s.sockets + 3, s.live) for s in last]
    assert growth(SlotSamples("gateway1", first + leaked), t0=0, window_s=16)["fds_growth"] == round(3 / 31, 4)
