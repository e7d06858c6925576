"""The real services the tests can run against: PostgreSQL and Redis on loopback.

`make test` (scripts/test.sh) starts throwaway servers of both where Debian's postgresql and
redis-server packages are installed, and exports CHATLOOM_TEST_POSTGRES_URL and CHATLOOM_TEST_REDIS_URL;
without them the PostgreSQL and Redis cases skip, naming the package to install. Each PostgreSQL case
gets a fresh, empty database (the app's migrations then build its schema, as in production), dropped
afterwards; each Redis case gets a key prefix of its own.

(A uniquely named module: the root conftest puts this folder on sys.path.)
"""
from __future__ import annotations

import glob
import os
import shutil
import uuid

import pytest
from sqlalchemy.engine import make_url

POSTGRES_ENV = "CHATLOOM_TEST_POSTGRES_URL"
REDIS_ENV = "CHATLOOM_TEST_REDIS_URL"


def postgres_url() -> str | None:
    return os.environ.get(POSTGRES_ENV) or None


def redis_url() -> str | None:
    return os.environ.get(REDIS_ENV) or None


def postgres_installed() -> bool:
    """Debian's postgresql package (what scripts/services.sh runs)."""
    return bool(glob.glob("/usr/lib/postgresql/*/bin/initdb"))


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _skip_reason(name: str, package: str, installed: bool, env: str) -> str:
    if not installed:
        return (f"{name} tests skipped: install Debian's {package} package (apt-get install {package}), "
                f"then run make test")
    return f"{name} tests skipped: {env} is not set (make test starts a throwaway {name} and sets it)"


def postgres_skip_reason() -> str:
    return _skip_reason("PostgreSQL", "postgresql", postgres_installed(), POSTGRES_ENV)


def redis_skip_reason() -> str:
    return _skip_reason("Redis", "redis-server", redis_server_binary() is not None, REDIS_ENV)


def require_postgres() -> str:
    url = postgres_url()
    if url is None:
        pytest.skip(postgres_skip_reason())
    return url


def require_redis() -> str:
    url = redis_url()
    if url is None:
        pytest.skip(redis_skip_reason())
    return url


async def _admin(url: str):
    import asyncpg  # only where PostgreSQL is tested

    u = make_url(url)
    return await asyncpg.connect(host=u.host or "127.0.0.1", port=u.port or 5432, user=u.username,
                                 password=u.password, database=u.database or "postgres")


async def create_database(url: str) -> str:
    """A new empty database on the server of `url`; returns its URL."""
    name = f"chatloom_t_{uuid.uuid4().hex[:12]}"
    conn = await _admin(url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return make_url(url).set(database=name).render_as_string(hide_password=False)


async def drop_database(url: str) -> None:
    name = make_url(url).database
    conn = await _admin(postgres_url() or url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


class PrivateRedis:
    """A redis-server of the test's own on a free loopback port, which the test may stop and start again
    (the shared one of $CHATLOOM_TEST_REDIS_URL must not be restarted under other tests)."""

    def __init__(self, port: int | None = None) -> None:
        import socket

        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = None

    def start(self) -> "PrivateRedis":
        import subprocess
        import time

        binary = redis_server_binary()
        if binary is None:
            pytest.skip(redis_skip_reason())
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis as sync_redis

        client = sync_redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except sync_redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None
