"""The multi-gateway suite: real `chatloom serve` processes sharing PostgreSQL and Redis on loopback.

Marked `fleet`; it skips where the services are missing (no $CHATLOOM_TEST_POSTGRES_URL, no
redis-server binary), naming the package to install; `make test` runs it where Debian's postgresql
and redis-server packages are installed (it starts throwaway servers), as .ci/run does.
Each gateway serves the tiny random model, so the suite stays quick; Redis is a private
redis-server the tests stop and start again.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from backing_services import (PrivateRedis, create_database, drop_database, postgres_skip_reason, postgres_url,
                              redis_server_binary, redis_skip_reason)

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180  # a loaded CI machine takes a while to import torch twice


def fleet_skip_reason() -> str | None:
    """Why the multi-gateway suite cannot run here, or None."""
    if postgres_url() is None:
        return postgres_skip_reason()
    if redis_server_binary() is None:  # each test runs a private redis-server it stops and starts
        return redis_skip_reason()
    return None


def pytest_collection_modifyitems(config, items):
    reason = fleet_skip_reason()
    for item in items:
        if "tests/fleet/" in str(item.fspath):
            item.add_marker(pytest.mark.fleet)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """One `chatloom serve` process."""

    def __init__(self, name: str, config: Path, workdir: Path) -> None:
        self.name = name
        self.config = config
        self.workdir = workdir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Gateway":
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CHATLOOM_GATEWAY": self.name}
        log = open(self.workdir / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "chatloom.cli", "serve", "--config", str(self.config),
                                      "--port", str(self.port)], cwd=self.workdir, env=env, stdout=log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {(self.workdir / f'{self.name}.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {START_TIMEOUT_S} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Fleet:
    def __init__(self, workdir: Path, redis: PrivateRedis, db_url: str) -> None:
        self.workdir = workdir
        self.redis = redis
        self.db_url = db_url
        tiers = workdir / "tiers.toml"
        # A small quota ('small', for the concurrency test); everyone else is on a generous 'free'.
        tiers.write_text('[free]\ntokens_per_minute = 1000000\ntokens_per_day = 100000000\n'
                         'requests_per_minute = 100000\nmax_concurrent = 1000\nmax_tokens = 2000\n'
                         '[small]\ntokens_per_minute = 400\ntokens_per_day = 1000000\nrequests_per_minute = 100000\n'
                         'max_concurrent = 1000\nmax_tokens = 2000\n')
        self.config = workdir / "chatloom.toml"
        self.config.write_text("\n".join([
            "[server]", f'db_url = "{db_url}"', f'data_dir = "{workdir}"', 'log_level = "warning"',
            "[shared_state]", f'redis_url = "{redis.url}"', 'prefix = "fleet"', 'job_lease_s = 1.5',
            'shutdown_grace_s = 0.0',
            "[accounts]", 'jwt_secret = "fleet-test-secret-0123456789abcdef012345"', 'argon2_time_cost = 1',
            'argon2_memory_kib = 1024',
            "[model]", 'name = "tiny-random"',
            "[engine]", 'num_blocks = 1024', 'max_num_seqs = 16', 'context_window = 2048',
            "[moderation]", 'mode = "off"',
            "[sampling]", 'temperature = 0.0', 'max_tokens_limit = 2000',
            "[traffic]", f'tiers_file = "{tiers}"', ""]))
        self.gateways = [Gateway("gw1", self.config, workdir), Gateway("gw2", self.config, workdir)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fleet")
    redis = PrivateRedis().start()
    db_url = asyncio.run(create_database(postgres_url()))
    fleet = Fleet(workdir, redis, db_url)
    try:
        for g in fleet.gateways:
            g.start()
        yield fleet
    finally:
        for g in fleet.gateways:
            g.stop()
        redis.stop()
        asyncio.run(drop_database(db_url))
