"""`make test`'s services: the skip message names the package to install, and scripts/test.sh starts
throwaway PostgreSQL and Redis, hands their URLs to the tests and stops them however the tests end."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import backing_services
from backing_services import postgres_installed, redis_server_binary, require_postgres, require_redis

ROOT = Path(__file__).resolve().parents[1]
URL_VARS = ("CHATLOOM_TEST_POSTGRES_URL", "CHATLOOM_TEST_REDIS_URL")


def _skip_message(require, monkeypatch) -> str:
    for var in URL_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        require()
    return str(skipped.value)


def test_without_postgresql_the_skip_names_the_package(monkeypatch):
    monkeypatch.setattr(backing_services, "postgres_installed", lambda: False)
    message = _skip_message(require_postgres, monkeypatch)
    assert message.startswith("PostgreSQL tests skipped: install Debian's postgresql package")
    assert "apt-get install postgresql" in message


def test_without_redis_the_skip_names_the_package(monkeypatch):
    monkeypatch.setattr(backing_services, "redis_server_binary", lambda: None)
    message = _skip_message(require_redis, monkeypatch)
    assert message.startswith("Redis tests skipped: install Debian's redis-server package")
    assert "apt-get install redis-server" in message


def test_installed_but_not_started_the_skip_names_make_test(monkeypatch):
    monkeypatch.setattr(backing_services, "postgres_installed", lambda: True)
    monkeypatch.setattr(backing_services, "redis_server_binary", lambda: "/usr/bin/redis-server")
    assert "CHATLOOM_TEST_POSTGRES_URL is not set (make test starts" in _skip_message(require_postgres, monkeypatch)
    assert "CHATLOOM_TEST_REDIS_URL is not set (make test starts" in _skip_message(require_redis, monkeypatch)


# -- scripts/test.sh, with a stand-in for pytest that reports what it was given ----------------------------

def _fake_python(tmp_path: Path, status: int) -> tuple[Path, Path]:
    """A $PY whose `-m pytest` records the services' URLs and whether their ports answer, then exits
    with `status`; `-c` (the free-port probe) runs the real Python."""
    report = tmp_path / "report"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -c ]; then exec {sys.executable} "$@"; fi
{sys.executable} - > {report} <<'PY'
import os, socket
from urllib.parse import urlsplit
for var in {URL_VARS!r}:
    url = os.environ.get(var, "")
    port = urlsplit(url).port if url else None
    up = False
    if port:
        with socket.socket() as s:
            up = s.connect_ex(("127.0.0.1", port)) == 0
    print(var, url, up)
print("DIR", os.environ.get("CHATLOOM_SERVICES_DIR", ""))
PY
exit {status}
""")
    fake.chmod(0o755)
    return fake, report


def _run_test_sh(fake: Path, env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in URL_VARS and k not in ("CHATLOOM_SERVICES_DIR", "CHATLOOM_PG_PORT", "CHATLOOM_REDIS_PORT")}
    return subprocess.run([str(ROOT / "scripts" / "test.sh")], env={**base, "PY": str(fake), **env},
                          capture_output=True, text=True, timeout=180)


def _report(path: Path) -> dict[str, list[str]]:
    return {line.split(" ")[0]: line.split(" ")[1:] for line in path.read_text().splitlines()}


def _answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.skipif(not (postgres_installed() and redis_server_binary()),
                    reason="needs Debian's postgresql and redis-server packages")
def test_make_test_starts_throwaway_services_and_stops_them_when_tests_fail(tmp_path):
    fake, report = _fake_python(tmp_path, status=3)
    done = _run_test_sh(fake, {})
    assert done.returncode == 3, done.stderr  # pytest's status comes through
    seen = _report(report)
    ports = []
    for var in URL_VARS:
        url, up = seen[var]
        assert url and up == "True", (var, seen, done.stderr)
        ports.append(int(url.rsplit(":", 1)[1].split("/")[0]))
    assert 55432 not in ports and 56379 not in ports  # free ports, not the fixed ones CI scripts default to
    scratch = seen["DIR"][0]
    assert scratch.startswith("/tmp/chatloom-test-services.")
    assert not any(_answers(p) for p in ports), "a service outlived make test"
    assert not Path(scratch).exists()


def test_make_test_uses_services_already_given(tmp_path):
    fake, report = _fake_python(tmp_path, status=0)
    given = {"CHATLOOM_TEST_POSTGRES_URL": "postgresql://chatloom@127.0.0.1:1/chatloom",
             "CHATLOOM_TEST_REDIS_URL": "redis://127.0.0.1:1/0"}
    done = _run_test_sh(fake, given)
    assert done.returncode == 0, done.stderr
    seen = _report(report)
    assert seen["CHATLOOM_TEST_POSTGRES_URL"][0] == given["CHATLOOM_TEST_POSTGRES_URL"]
    assert seen["CHATLOOM_TEST_REDIS_URL"][0] == given["CHATLOOM_TEST_REDIS_URL"]
    assert seen["DIR"] == [""]  # nothing started
