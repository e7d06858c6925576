"""A small fleet of real replica processes shared by the fleet tests (starting one takes seconds)."""
from __future__ import annotations

import pytest

from fleet_testing import start_replicas


@pytest.fixture(scope="session")
def fleet():
    """Three tiny-random replicas. A test that kills one must relaunch it before it ends."""
    reps = start_replicas(3)
    yield reps
    for r in reps:
        r.stop()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from chatloom.models import load_tokenizer

    return load_tokenizer("tiny-random")
