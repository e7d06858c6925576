"""Start-up: /healthz answers while the model loads, /readyz only once it is loaded; the CLI."""
from __future__ import annotations

import asyncio
import time

import httpx

from chatloom.cli import serve as app_cli
from chatloom.app.main import create_app
from chatloom.serving import LocalBackend

from app_testing import make_settings, signup


class GatedBackend(LocalBackend):
    """A LocalBackend whose start() waits for the test to open the gate."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()

    async def start(self) -> None:
        await self.gate.wait()
        await super().start()


async def test_healthz_answers_while_the_model_loads(tmp_path, tiny_model_fp32):
    backend = GatedBackend(tiny_model_fp32)
    app = create_app(make_settings(tmp_path), backend)
    try:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                assert (await client.get("/healthz")).status_code == 200
                r = await client.get("/readyz")
                assert r.status_code == 503 and r.json() == {"status": "loading"}
                alice = await signup(client, "alice")
                cid = (await client.post("/conversations", headers=alice)).json()["id"]
                r = await client.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hi"})
                assert r.status_code == 503 and r.headers["retry-after"] == "5"
                conv = (await client.get(f"/conversations/{cid}", headers=alice)).json()
                assert conv["messages"] == []  # nothing saved for a refused message

                backend.gate.set()
                deadline = time.monotonic() + 60  # generous: CI machines are slow and shared
                while time.monotonic() < deadline:
                    if (await client.get("/readyz")).status_code == 200:
                        break
                    await asyncio.sleep(0.02)
                assert (await client.get("/readyz")).json()["models"] == ["tiny-random"]
                r = await client.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hi"})
                assert r.status_code == 200 and '"done": true' in r.text
    finally:
        await backend.close()


async def test_a_model_that_fails_to_load_is_reported(tmp_path):
    backend = LocalBackend(str(tmp_path / "missing.gguf"))
    app = create_app(make_settings(tmp_path), backend)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                r = await client.get("/readyz")
                if r.json()["status"] != "loading":
                    break
                await asyncio.sleep(0.02)
            assert r.status_code == 503 and r.json()["status"] == "failed" and "missing.gguf" in r.json()["error"]


def test_keys_create_prints_a_working_key(tmp_path, capsys, tiny_backend):
    import argparse

    parser = argparse.ArgumentParser()
    app_cli.register(parser.add_subparsers(dest="command"))
    db = f"sqlite:///{tmp_path}/chatloom.db"

    args = parser.parse_args(["keys", "create", "--user", "ops", "--db", db, "--create-user"])
    assert args.func(args) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("cl-")

    async def use_key():
        app = create_app(make_settings(tmp_path, server={"db_url": db}), tiny_backend)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                me = await client.get("/auth/me", headers={"Authorization": f"Bearer {key}"})
                assert me.status_code == 200 and me.json()["username"] == "ops" and me.json()["is_admin"]
                # No password: the account cannot log in, only use keys.
                r = await client.post("/auth/login", json={"username": "ops", "password": "anything"})
                assert r.status_code == 401

    asyncio.run(use_key())
    args = parser.parse_args(["serve", "--port", "9999", "--model", "tiny-random", "--db", db])
    assert args.func is app_cli.cmd_serve
    settings = app_cli._settings(args)
    assert (settings.server.port, settings.model.name, settings.server.db_url, settings.server.host) == (9999, "tiny-random", db, "127.0.0.1")


def test_settings_file(tmp_path):
    import pytest

    from chatloom.settings import load_settings

    path = tmp_path / "chatloom.toml"
    path.write_text('[server]\nport = 9000\n[chat]\nsystem_prompt = "Talk like a pirate."\n'
                    '[engine]\ncontext_window = 1024\n')
    s = load_settings(path)
    assert (s.server.port, s.chat.system_prompt, s.engine.context_window, s.server.host) == \
        (9000, "Talk like a pirate.", 1024, "127.0.0.1")
    path.write_text("[server]\nprot = 9000\n")
    with pytest.raises(ValueError, match="unknown setting server.prot"):
        load_settings(path)


def test_serve_engine_flags_reach_the_engine_config(tmp_path):
    import argparse

    from chatloom.app.main import default_backend

    parser = argparse.ArgumentParser()
    app_cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "tiny-random", "--kv-cache-gb", "0.25", "--max-num-seqs", "8",
                              "--max-num-batched-tokens", "128", "--db", f"sqlite+aiosqlite:///{tmp_path}/x.db"])
    settings = app_cli._settings(args)
    backend = default_backend(settings)
    assert (backend._config.kv_cache_gb, backend._config.max_num_seqs, backend._config.max_num_batched_tokens) == (
        0.25, 8, 128)
