"""The chaos run's fleet on loopback: its own PostgreSQL and Redis, three replicas of the tiny random
model, two HTTP/2 gateways in front of them, and a small tmpfs as the gateways' data folder (where
uploads go), so the disk can be filled without touching the machine's.

stop() undoes everything start() did, in any state (half started, processes stopped or dead), and is
safe to call twice.
"""
from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
from pathlib import Path

from chatloom.bench.chaos.processes import Gate, Gateway, Replica, make_certificate
from chatloom.bench.chaos.services import Postgres, Redis

MODEL = "tiny-random"
JWT_SECRET = "chaos-run-secret-0123456789abcdef0123456789"
DISK_MIB = 16  # the data tmpfs when empty: the disk_full fault fills what is free of it
# Room added per second of traffic for the uploads the run keeps (each is checked at the end): the files
# user uploads about 20 KB a second (2-40 KB, then a 0.5-1.5 s pause); a 15-minute run stored 15 MB.
UPLOAD_KIB_PER_S = 48

TIERS = """\
[free]
tokens_per_minute = 200000
tokens_per_day = 10000000
requests_per_minute = 10000
max_concurrent = 8
max_tokens = 256

[plus]
tokens_per_minute = 400000
tokens_per_day = 20000000
requests_per_minute = 10000
max_concurrent = 16
max_tokens = 256
priority = 1

[tiny]
tokens_per_minute = 100000
tokens_per_day = {tiny_day}
requests_per_minute = 10000
max_concurrent = 4
max_tokens = 256
"""


class Topology:
    def __init__(self, folder: Path, tiny_tokens_per_day: int = 1500, window_s: float = 0.0) -> None:
        self.folder = folder
        self.disk_mib = DISK_MIB + math.ceil(window_s * UPLOAD_KIB_PER_S / 1024)
        self.tiny_tokens_per_day = tiny_tokens_per_day
        # PostgreSQL runs as the postgres user when root, which must reach its folder: one of its own
        # under the temp folder, open to it, wherever the run's folder is.
        self.gate = Gate()
        self.pg_folder = Path(tempfile.mkdtemp(prefix="chatloom-chaos-pg-"))
        self.pg_folder.chmod(0o755)
        self.postgres = Postgres(self.pg_folder / "postgres", self.gate)
        self.redis = Redis(folder / "redis", self.gate)
        self.data = folder / "data"
        self.tmpfs: bool = False
        self.tmpfs_error: str | None = None
        self.replicas = [Replica(f"replica{i}", folder, self.gate, MODEL) for i in (1, 2, 3)]
        self.gateways: list[Gateway] = []

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._mount()
        for r in self.replicas:  # the slow part (importing torch) overlaps with the services' start
            r.launch()
        self.postgres.start()
        self.redis.start()
        cert = make_certificate(self.folder)
        config = self._write_config()
        urls = [r.url for r in self.replicas]
        for r in self.replicas:
            r.wait_ready()
        self.gateways = [Gateway(f"gateway{i}", self.folder, self.gate, config, cert, urls) for i in (1, 2)]
        # One gateway first: it runs the database migrations, which two at once would race on.
        self.gateways[0].launch().wait_ready()
        self.gateways[1].launch().wait_ready()

    def _mount(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.disk_mib}m,mode=0755", "tmpfs", str(self.data)],
                              capture_output=True, text=True)
        self.tmpfs = done.returncode == 0
        if not self.tmpfs:
            self.tmpfs_error = (done.stderr or done.stdout).strip() or f"mount exited {done.returncode}"

    def _write_config(self) -> Path:
        tiers = self.folder / "tiers.toml"
        tiers.write_text(TIERS.format(tiny_day=self.tiny_tokens_per_day))
        config = self.folder / "chatloom.toml"
        config.write_text("\n".join([
            "[server]", f'db_url = "{self.postgres.url}"', f'data_dir = "{self.data}"', 'log_level = "warning"',
            "[shared_state]", f'redis_url = "{self.redis.url}"', 'prefix = "chaos"', "job_lease_s = 3.0",
            "shutdown_grace_s = 5.0",
            "[accounts]", f'jwt_secret = "{JWT_SECRET}"', "argon2_time_cost = 1", "argon2_memory_kib = 1024",
            "[model]", f'name = "{MODEL}"',
            # A minute, not ten: Redis's data is then at its steady size a minute after each restart, so
            # comparing its memory between the run's quarters finds keys that outlive it, not wipe timing.
            "[chat]", 'tools = ""', "event_log_retention_s = 60",
            "[moderation]", 'mode = "off"',
            "[sampling]", "max_tokens_limit = 256",
            "[traffic]", f'tiers_file = "{tiers}"', ""]))
        return config

    def stop(self) -> None:
        """Stop everything; from then on nothing starts (a fault's restart in a worker thread included)."""
        self.gate.close()
        for child in [*self.gateways, *self.replicas]:
            try:
                child.kill()
            except Exception:  # noqa: BLE001 - every other child must still be stopped
                pass
        for service in (self.redis, self.postgres):
            try:
                service.stop()
            except Exception:  # noqa: BLE001
                pass
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.data)], capture_output=True)
            self.tmpfs = False

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        shutil.rmtree(self.pg_folder, ignore_errors=True)
