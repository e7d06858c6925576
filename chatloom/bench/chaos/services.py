"""The chaos run's own PostgreSQL and Redis, from Debian's packages, in the run's scratch folder.

Both listen on free loopback ports and can be stopped and started again on the same port, which is
what the faults do. PostgreSQL runs as the `postgres` user when the run is root (initdb refuses root),
as scripts/services.sh does; fsync is off, the data being scratch. Redis keeps its dump file in its
own folder: a restart "with its data" shuts down with SHUTDOWN SAVE and loads the file back, one
"without" is a SIGKILL and the file deleted.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from chatloom.bench.chaos.processes import Gate
from chatloom.bench.server_process import free_port

START_TIMEOUT_S = 60.0


class ServiceMissing(RuntimeError):
    """A Debian package the run needs is not installed."""


def postgres_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise ServiceMissing("PostgreSQL is not installed: apt-get install postgresql")
    return Path(found[-1]).parent


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise ServiceMissing("Redis is not installed: apt-get install redis-server")
    return found


def _as_postgres(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


class Postgres:
    """A private PostgreSQL cluster; `url` names its `chatloom` database."""

    def __init__(self, folder: Path, gate: Gate | None = None) -> None:
        self.folder = folder
        self.gate = gate or Gate()
        self.bin = postgres_bin()
        self.port = free_port()
        self.url = f"postgresql://chatloom@127.0.0.1:{self.port}/chatloom"
        self.data = folder / "data"
        self.ready_at: float | None = None

    def _run(self, *argv: str, timeout: float = START_TIMEOUT_S) -> None:
        done = subprocess.run(_as_postgres([str(self.bin / argv[0]), *argv[1:]]), capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"PostgreSQL's {argv[0]} failed ({done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-500:]}")

    def start(self) -> "Postgres":
        self.folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres")
        if not (self.data / "PG_VERSION").exists():
            self._run("initdb", "-D", str(self.data), "-U", "chatloom", "-A", "trust", "--no-sync")
            fresh = True
        else:
            fresh = False
        with self.gate.starting("PostgreSQL"):
            self._run("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "log"), "-w", "-t", "60", "start", "-o",
                      f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.folder} -c fsync=off "
                      "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        if fresh:
            self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "chatloom", "chatloom")
        self.ready_at = time.monotonic()
        return self

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
            except (RuntimeError, subprocess.TimeoutExpired):
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


class Redis:
    """A private redis-server whose dump file lives in `folder`."""

    def __init__(self, folder: Path, gate: Gate | None = None) -> None:
        self.folder = folder
        self.gate = gate or Gate()
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.ready_at: float | None = None

    def start(self) -> "Redis":
        import redis as sync_redis

        self.folder.mkdir(parents=True, exist_ok=True)
        with self.gate.starting("Redis"), open(self.folder / "log", "ab") as log:
            self.proc = subprocess.Popen([redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save",
                                          "", "--appendonly", "no", "--dir", str(self.folder), "--dbfilename",
                                          "dump.rdb"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        client = sync_redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                try:
                    client.ping()
                    self.ready_at = time.monotonic()
                    return self
                except sync_redis.exceptions.BusyLoadingError:
                    pass
                except sync_redis.ConnectionError:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"redis-server exited (see {self.folder / 'log'})") from None
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not answer within a minute")
                time.sleep(0.05)
        finally:
            client.close()

    def restart(self, keep_data: bool) -> None:
        """Stop and start again: with its data saved to the dump file and loaded back, or empty."""
        self.stop(keep_data)
        self.start()

    def stop(self, keep_data: bool = False) -> None:
        """SHUTDOWN SAVE (the data kept in the dump file, nothing accepted after the save), or SIGKILL
        and the dump file deleted."""
        import redis as sync_redis

        if self.proc is None:
            return
        if keep_data and self.proc.poll() is None:
            client = sync_redis.Redis(host="127.0.0.1", port=self.port)
            try:
                client.shutdown(save=True)
            except sync_redis.ConnectionError:
                pass  # the server closing the connection is its answer
            finally:
                client.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        if not keep_data:
            (self.folder / "dump.rdb").unlink(missing_ok=True)
        self.proc = None

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None
