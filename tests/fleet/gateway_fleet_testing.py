"""Helpers for the fleet suite (a uniquely named module, so the tests import it directly)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def set_tier(config: Path, workdir: Path, user: str, tier: str) -> None:
    """`chatloom users set-tier` against the fleet's shared database, as an operator would."""
    subprocess.run([sys.executable, "-m", "chatloom.cli", "users", "set-tier", user, tier, "--config", str(config)],
                   cwd=workdir, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, capture_output=True)
