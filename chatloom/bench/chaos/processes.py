"""The chaos run's chatloom processes: replicas and gateways on fixed loopback ports, so a restarted
process comes back where the others expect it; and the self-signed certificate the gateways serve
HTTP/2 with.

Every child runs in a session of its own (start_new_session) and is signalled as a process group, so
nothing it starts outlives the run. Start-up waits tolerate a loaded machine: importing torch on two
shared cores can take a minute.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx

from chatloom.bench.server_process import free_port

START_TIMEOUT_S = 240.0
ROOT = Path(__file__).resolve().parents[3]


class Stopping(RuntimeError):
    """The run is stopping: nothing more is started."""


class Gate:
    """Shared by a run's processes. Once closed, nothing more starts: a fault's restart, running in a
    worker thread, must not start a process after the run's cleanup has stopped the others."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entered by a signal handler that interrupts a start
        self.closed = False

    @contextlib.contextmanager
    def starting(self, what: str) -> Iterator[None]:
        with self.lock:  # held while the process is spawned, so close() waits for it to be known
            if self.closed:
                raise Stopping(f"not starting {what}: the run is stopping")
            yield

    def close(self) -> None:
        with self.lock:
            self.closed = True


def make_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost (PEM cert, PEM key)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class Child:
    """One chatloom process, restartable on the same port. `name` labels its log and its samples."""

    health_path = "/health"
    scheme = "http"

    def __init__(self, name: str, folder: Path, gate: Gate) -> None:
        self.name = name
        self.folder = folder
        self.gate = gate
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.ready_at: float | None = None  # when the current process first answered its health check

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CHATLOOM_RUNTIME__KERNELS": "0"}

    def launch(self) -> "Child":
        with self.gate.starting(self.name), open(self.folder / f"{self.name}.log", "ab") as log:
            self.proc = subprocess.Popen(self.argv(), env=self.env(), cwd=self.folder, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        self.ready_at = None
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "Child":
        deadline = time.monotonic() + timeout_s
        with httpx.Client(verify=False, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.gate.closed:
                    raise Stopping(f"{self.name}: the run is stopping")
                if self.proc is None or self.proc.poll() is not None:
                    tail = (self.folder / f"{self.name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{self.name} exited before it was ready:\n{tail}")
                try:
                    if client.get(self.url + self.health_path).status_code == 200:
                        self.ready_at = time.monotonic()
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        raise RuntimeError(f"{self.name} was not ready after {timeout_s:.0f} s")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=60)

    def terminate(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM and wait for the exit (SIGKILL past `timeout_s`); the exit status."""
        if self.proc is None:
            return None
        self.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode


class Replica(Child):
    """`chatloom replica` of the tiny random-weight model."""

    def __init__(self, name: str, folder: Path, gate: Gate, model: str, num_blocks: int = 1024) -> None:
        super().__init__(name, folder, gate)
        self.model = model
        self.num_blocks = num_blocks

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "chatloom.cli", "replica", "--model", self.model, "--port", str(self.port),
                "--num-blocks", str(self.num_blocks), "--threads", "1", "--max-num-seqs", "16"]


class Gateway(Child):
    """`chatloom serve` over HTTP/2 (TLS) in front of the replicas."""

    health_path = "/readyz"
    scheme = "https"

    def __init__(self, name: str, folder: Path, gate: Gate, config: Path, cert: tuple[Path, Path],
                 replicas: list[str]) -> None:
        super().__init__(name, folder, gate)
        self.config = config
        self.cert = cert
        self.replicas = replicas

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "chatloom.cli", "serve", "--config", str(self.config), "--port", str(self.port),
                "--tls-cert", str(self.cert[0]), "--tls-key", str(self.cert[1])]
        for url in self.replicas:
            argv += ["--replica", url]
        return argv

    def env(self) -> dict[str, str]:
        return {**super().env(), "CHATLOOM_GATEWAY": self.name}
