"""A server under test as a child process: started, waited for until it answers, its memory sampled, stopped.

`chatloom bench sizes` runs chatloom, llama-server and vLLM one at a time with this. The time to ready is
from the spawn to the first answered one-token request (loading, warm-up, whatever each server does
before it can serve). Resident memory is the sum over the process and its children (vLLM runs its
engine in a child), sampled every 100 ms by a thread so the peak during a run is seen, alongside the
kernel's own high-water mark of the main process.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            found.extend(int(c) for c in text)
    except OSError:
        pass
    return found


def tree_pids(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += _status_kib(p, "VmRSS") * 1024
        todo.extend(_children(p))
    return total


@dataclass
class ServerProcess:
    """One server: `argv` started with `env` added, answering OpenAI-style requests at `base_url`."""

    label: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    load_s: float | None = None
    peak_rss: int = 0
    context_window: int | None = None
    _sampling: bool = False
    _thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self._t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._sampling = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while self._sampling and self.proc is not None and self.proc.poll() is None:
            self.peak_rss = max(self.peak_rss, tree_rss_bytes(self.proc.pid))
            time.sleep(0.1)

    def wait_ready(self, timeout_s: float, extra: dict | None = None) -> str:
        """Wait until a one-token chat request is answered; returns the model id the server lists."""
        deadline = self._t0 + timeout_s
        with httpx.Client(timeout=30.0) as client:
            served = None
            while time.perf_counter() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"{self.label} exited with status {self.proc and self.proc.returncode} "
                                       f"before it was ready{self._log_hint()}")
                try:
                    if served is None:
                        r = client.get(self.base_url + "/v1/models")
                        if r.status_code == 200 and r.json().get("data"):
                            served = r.json()["data"][0]["id"]
                            # chatloom and vLLM say their context window here (llama-server does not).
                            self.context_window = r.json()["data"][0].get("max_model_len")
                    if served is not None:
                        r = client.post(self.base_url + "/v1/chat/completions", json={
                            "model": served, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                            "temperature": 0, **(extra or {})})
                        if r.status_code == 200:
                            self.load_s = time.perf_counter() - self._t0
                            return served
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.25)
        raise RuntimeError(f"{self.label} was not ready after {timeout_s:.0f} s{self._log_hint()}")

    def rss(self) -> int:
        return tree_rss_bytes(self.proc.pid) if self.proc is not None else 0

    def high_water(self) -> int:
        """The most resident memory seen: the sampled peak of the tree, or the main process's own mark."""
        own = _status_kib(self.proc.pid, "VmHWM") * 1024 if self.proc is not None else 0
        return max(self.peak_rss, own, self.rss())

    def stop(self) -> None:
        self._sampling = False
        if self.proc is None:
            return
        # The whole group: a server's children (vLLM's engine) go with it, and none outlives the run.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def _log_hint(self) -> str:
        return f" (its log: {self.log_path})" if self.log_path else ""
