"""The files tests run with passages embedded too (files.embeddings is off by default), by the served tiny
model: its path through the pipeline stays covered; test_builtin_embeddings.py covers the default embedder."""
from __future__ import annotations

import pytest

from app_testing import make_settings


@pytest.fixture
def settings(tmp_path, db_url):
    return make_settings(tmp_path, server={"db_url": db_url},
                         files={"embeddings": True, "embedding_model": "tiny-random"})
