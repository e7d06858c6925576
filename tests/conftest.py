"""Shared fixtures: the tiny random model for fast tests, the real SmolLM2 for the few that need it."""
from __future__ import annotations

import pytest
import torch

from chatloom.models import LoadedModel, load_model

# One intra-op thread: the tests' models are tiny, and OpenMP threads that spin-wait
# for a busy second core turn microsecond ops into milliseconds.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """tiny-random in float64, so batched and reference paths agree bit-for-bit in argmax."""
    return load_model("tiny-random", "fp64")


@pytest.fixture(scope="session")
def tiny_model_fp32() -> LoadedModel:
    return load_model("tiny-random", "fp32")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct (about 10 s to load); used by few tests."""
    return load_model("smollm2-135m-instruct", "fp32")
