"""A model that cannot load: `chatloom serve` ends at start (one line, exit 2); an app embedded
without the CLI stays up and says why on /readyz."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from chatloom.app.main import create_app
from chatloom.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 300,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-5}


def _model_folder(path: Path, config: dict) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def _serve(model: Path, workdir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    # Port 0: the process must end before it would ever listen; the timeout is the test's failure.
    return subprocess.run([sys.executable, "-m", "chatloom.cli", "serve", "--model", str(model), "--port", "0",
                           "--num-blocks", "32",  # a small pool: the memory check never decides the outcome
                           "--db", f"sqlite+aiosqlite:///{workdir}/chatloom.db"],
                          capture_output=True, text=True, timeout=120, cwd=workdir, env=env)


def test_serve_exits_with_one_line_for_an_unsupported_architecture(tmp_path):
    model = _model_folder(tmp_path / "mamba-model", {"model_type": "mamba"})
    done = _serve(model, tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("chatloom: error: unsupported architecture 'mamba'"), lines[0]


def test_serve_exits_when_the_model_fails_while_loading(tmp_path):
    # The config reads fine, so the server starts; the load then fails (no tokenizer, no weights).
    model = _model_folder(tmp_path / "no-weights", LLAMA_CONFIG)
    done = _serve(model, tmp_path)
    assert done.returncode == 2, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("chatloom: error: model failed to load:") and "tokenizer.json" in last, done.stderr


async def test_an_embedded_app_stays_up_and_reports_the_failure(tmp_path):
    model = _model_folder(tmp_path / "no-weights", LLAMA_CONFIG)
    app = create_app(Settings(model={"name": str(model)}, engine={"num_blocks": 32},
                              server={"data_dir": str(tmp_path), "db_url": f"sqlite+aiosqlite:///{tmp_path}/chatloom.db"}))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            for _ in range(200):  # the load runs in the background: wait for its verdict
                if (await client.get("/readyz")).json()["status"] == "failed":
                    break
                await asyncio.sleep(0.05)
            response = await client.get("/readyz")
    assert response.status_code == 503
    assert "tokenizer.json" in response.text
    assert "failed to load" in app.state.startup_failure
