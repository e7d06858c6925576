"""N replica processes on this machine (`chatloom serve --local-replicas N`, `chatloom bench router`).

Why processes and not threads: each replica is an engine with its own KV cache and its own CPU
threads, exactly as it would run on its own machine; the router in front reaches them over HTTP
like any other. One command brings up the whole layout on a laptop.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalReplicas:
    """Start `count` replicas of `model` on loopback ports; stop() ends them all."""

    def __init__(self, model: str, count: int, threads: int = 1, extra_args: list[str] | None = None,
                 base_port: int | None = None, log_dir: str | None = None) -> None:
        if count < 1:
            raise ValueError("--local-replicas needs at least 1")
        self.model = model
        self.count = count
        self.threads = threads
        self.extra_args = extra_args or []
        self.ports = [base_port + i for i in range(count)] if base_port else [free_port() for _ in range(count)]
        self.log_dir = Path(log_dir) if log_dir else None
        self.procs: list[subprocess.Popen] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def start(self, timeout: float = 600.0) -> list[str]:
        """Launch every replica and wait until each answers /health; the URLs. Raises RuntimeError
        (with the replica's last log lines) if one exits or does not come up in time."""
        try:
            self._wait([self._launch(port) for port in self.ports], timeout)
        except BaseException:
            self.stop()
            raise
        return self.urls

    def add(self, timeout: float = 600.0) -> str:
        """Start one more replica (a fleet growing) and wait until it answers; its URL. A replica that
        fails to come up is stopped again and RuntimeError says why."""
        port = free_port()
        proc = self._launch(port)
        try:
            self._wait([proc], timeout)
        except BaseException:
            self._end(proc)
            raise
        self.ports.append(port)
        return f"http://127.0.0.1:{port}"

    def stop_one(self, url: str) -> None:
        """End the replica at `url` (the router has drained it first)."""
        proc = next((p for p in self.procs if p.url == url.rstrip("/")), None)
        if proc is None:
            raise ValueError(f"no local replica at {url!r}")
        self.ports.remove(int(url.rstrip("/").rsplit(":", 1)[1]))
        self._end(proc)

    def _launch(self, port: int) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        log = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"replica-{port}.log", "wb")  # noqa: SIM115 (the child owns it)
        proc = subprocess.Popen(
            [sys.executable, "-m", "chatloom.cli", "replica", "--model", self.model, "--port", str(port),
             "--threads", str(self.threads), *self.extra_args],
            env=env, stdout=log, stderr=subprocess.STDOUT if self.log_dir else subprocess.PIPE)
        proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    @staticmethod
    def _wait(procs: list[subprocess.Popen], timeout: float) -> None:
        deadline = time.time() + timeout
        pending = list(procs)
        while pending:
            if time.time() > deadline:
                raise RuntimeError(f"local replicas not ready in {timeout:.0f} s: "
                                   f"{', '.join(p.url for p in pending)}")
            for proc in list(pending):
                if proc.poll() is not None:
                    tail = proc.stderr.read().decode(errors="replace").strip().splitlines()[-1:] if proc.stderr else []
                    raise RuntimeError(f"local replica {proc.url} exited: {' '.join(tail) or 'see its log'}")
                try:
                    if httpx.get(proc.url + "/health", timeout=1.0).status_code == 200:
                        pending.remove(proc)
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)

    def _end(self, proc: subprocess.Popen) -> None:
        if proc in self.procs:
            self.procs.remove(proc)
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        if proc.stderr:
            proc.stderr.close()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
            if p.stderr:
                p.stderr.close()
        self.procs.clear()

    def __enter__(self) -> "LocalReplicas":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
