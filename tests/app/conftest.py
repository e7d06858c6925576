"""Fixtures for the app tests: the tiny random model behind a LocalBackend, an app per test
(a fresh SQLite file, and a fresh PostgreSQL database where one is given), an httpx client over ASGI, and accounts."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from chatloom.app.main import create_app
from chatloom.app.core.settings import Settings
from chatloom.engine import EngineConfig
from chatloom.serving import LocalBackend

from app_testing import LiveServer, make_settings, signup


@pytest.fixture(scope="session")
def tiny_backend(tiny_model_fp32):
    """One engine for the whole session (the tiny model loads instantly, but threads are not free)."""
    backend = LocalBackend(tiny_model_fp32, engine_config=EngineConfig(num_blocks=512, max_num_seqs=16))
    asyncio.run(backend.start())
    yield backend
    asyncio.run(backend.close())


@pytest.fixture
def settings(tmp_path, db_url) -> Settings:
    """Each test of the app fixture runs on SQLite and on PostgreSQL (db_url: skipped without a server)."""
    return make_settings(tmp_path, db_url=db_url)


@pytest.fixture
async def app(settings, tiny_backend):
    app = create_app(settings, tiny_backend)
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def client(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


@pytest.fixture
async def alice(client) -> dict:
    return await signup(client, "alice")


@pytest.fixture
async def bob(client) -> dict:
    return await signup(client, "bob")


# -- a live uvicorn server per test module ---------------------------------------------

@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_backend):
    settings = make_settings(tmp_path_factory.mktemp("live"), default_max_tokens=16)
    with LiveServer(create_app(settings, tiny_backend)) as server:
        yield server


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def admin(http) -> dict:
    """The first account on this server, so it may read /admin/stats."""
    r = http.post("/auth/signup", json={"username": "admin", "password": "correct horse"})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}
