"""Real replica processes on loopback ports, for the fleet tests (tiny-random model, one thread each)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ReplicaProcess:
    """`chatloom replica` in a child process; start() returns once /health says ok."""

    def __init__(self, model: str = "tiny-random", port: int | None = None, num_blocks: int = 512,
                 extra: list[str] | None = None) -> None:
        self.model = model
        self.port = port or free_port()
        self.num_blocks = num_blocks
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> "ReplicaProcess":
        # The tiny model needs no C++ kernels; skipping them keeps a replica start to seconds.
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CHATLOOM_RUNTIME__KERNELS": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chatloom.cli", "replica", "--model", self.model, "--port", str(self.port),
             "--num-blocks", str(self.num_blocks), "--threads", "1", *self.extra],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
        return self

    def wait_ready(self, timeout: float = 180.0) -> "ReplicaProcess":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"replica exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"replica on port {self.port} not ready in {timeout} s")

    def kill(self) -> None:
        """SIGKILL: the replica dies at once, mid-answer, as a crashed machine would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()


def start_replicas(n: int, **kw) -> list[ReplicaProcess]:
    """Start n replicas at once (their imports overlap) and wait for all of them."""
    reps = [ReplicaProcess(**kw).launch() for _ in range(n)]
    try:
        for r in reps:
            r.wait_ready()
    except BaseException:
        for r in reps:
            r.stop()
        raise
    return reps
