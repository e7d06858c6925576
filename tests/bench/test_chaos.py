"""`chatloom bench chaos --short`: the fleet under one fault of each kind, and every invariant holds.

Marked `chaos`; it runs where Debian's postgresql and redis-server are installed (as .ci/run does) and
skips, naming the package, where they are not. About 4 minutes on a 2-core machine.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from chatloom.bench.chaos.faults import KINDS
from chatloom.bench.chaos.report import table
from chatloom.bench.chaos.services import ServiceMissing, postgres_bin, redis_binary

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(480)]


@pytest.fixture(scope="module")
def result():
    try:
        postgres_bin()
        redis_binary()
    except ServiceMissing as exc:
        pytest.skip(str(exc))
    from chatloom.bench.chaos.run import ChaosConfig, run_chaos

    return run_chaos(ChaosConfig(short=True, seed=1), progress=lambda line: None)


def test_every_fault_kind_fires_and_every_invariant_holds(result):
    counts = result["fault_counts"]
    kinds = [k for k in KINDS if k != "disk_full" or result["tmpfs"]]
    assert all(counts.get(k, 0) >= 1 for k in kinds), counts
    assert counts["client_cut"] >= 1, counts
    failed = {c["name"]: c["failures"][:5] for c in result["invariants"] if not c["ok"]}
    if failed:  # the tables last: a CI log keeps the end of the output
        pytest.fail(f"failures (up to 5 each): {failed}\n\n{table(result)}", pytrace=False)


def test_nothing_is_left_running_or_mounted(result):
    with open("/proc/mounts") as f:
        mounts = f.read()
    procs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    for folder in result["folders"]:
        assert folder not in mounts
        assert not os.path.exists(folder)
        assert folder not in procs
