"""Shared fixtures: the tiny random model for fast tests, the real SmolLM2 for the few that need it."""
from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile

import pytest
import torch

from chatloom.models import LoadedModel, load_model

from backing_services import create_database, drop_database, require_postgres

# One intra-op thread: the tests' models are tiny, and OpenMP threads that spin-wait
# for a busy second core turn microsecond ops into milliseconds.
torch.set_num_threads(1)

# Every test signs up and signs in from loopback, many times over: the brute-force limits (accounts.*) are
# raised for the whole suite, servers it starts included, and tested on their own with their own values.
os.environ.setdefault("CHATLOOM_ACCOUNTS__SIGNUPS_PER_ADDRESS", "1000000")
os.environ.setdefault("CHATLOOM_ACCOUNTS__LOGIN_FAILURES_PER_ADDRESS", "1000000")
os.environ.setdefault("CHATLOOM_ACCOUNTS__LOGIN_FAILURES_PER_ACCOUNT", "1000000")
# Commands and servers the suite starts keep packed K-quant weights (model.weight_cache) in a folder of the
# run's own, never in the user's cache; tests/models/test_panel_cache.py tests the cache itself.
if "CHATLOOM_MODEL__WEIGHT_CACHE" not in os.environ:
    _weight_cache = tempfile.mkdtemp(prefix="chatloom-tests-")
    atexit.register(shutil.rmtree, _weight_cache, True)
    os.environ["CHATLOOM_MODEL__WEIGHT_CACHE"] = os.path.join(_weight_cache, "weights")


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


# -- the database: SQLite (embedded default) and PostgreSQL (a real server, when one is given) ----------

@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """One test, both backends: a fresh SQLite file, or a fresh database on the PostgreSQL server of
    $CHATLOOM_TEST_POSTGRES_URL (skipped without it). Either starts empty; migrations build the schema."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/chatloom.db"
        return
    url = asyncio.run(create_database(require_postgres()))
    yield url
    asyncio.run(drop_database(url))
