"""Fixtures the API tests share."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from chatloom.engine import EngineConfig
from chatloom.models import load_model
from chatloom.serving import LocalBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import tiny_vision as tv  # noqa: E402


@pytest.fixture(scope="module")
def vision_backend(tmp_path_factory):
    """A tiny random-weight Idefics3 model (tests/models/tiny_vision.py) served in this process."""
    loaded = load_model(str(tv.write_idefics3_folder(tmp_path_factory.mktemp("vision") / "tiny-vlm")), "fp32")
    backend = LocalBackend(loaded, engine_config=EngineConfig(num_blocks=256))
    asyncio.run(backend.start())
    yield backend
    asyncio.run(backend.close())
