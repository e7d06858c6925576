"""No secret reaches a log: a real `chatloom serve` at debug level, its access log on, is sent passwords,
session tokens, API keys (in both headers), a shared link's token and an SSO callback's code and state,
and everything it wrote is searched for them."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app_testing import free_port

ROOT = Path(__file__).resolve().parents[3]
PASSWORD = "hunter2-correct-horse-battery"


def _serve(tmp: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CHATLOOM_RUNTIME__KERNELS": "0",
           "CHATLOOM_SERVER__LOG_LEVEL": "debug", "CHATLOOM_CHAT__TOOLS": "",
           "CHATLOOM_ACCOUNTS__ARGON2_TIME_COST": "1", "CHATLOOM_ACCOUNTS__ARGON2_MEMORY_KIB": "1024"}
    proc = subprocess.Popen([sys.executable, "-m", "chatloom.cli", "serve", "--model", "tiny-random", "--port",
                             str(port)], cwd=tmp, env={**env, "CHATLOOM_SERVER__DATA_DIR": str(tmp)}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("chatloom serve did not get ready")


def test_no_secret_is_ever_written_to_a_log(tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    proc = _serve(tmp_path, port, log)
    secrets: list[str] = [PASSWORD]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            r = http.post("/auth/signup", json={"username": "alice", "password": PASSWORD})
            token = r.json()["token"]
            secrets.append(token)
            auth = {"Authorization": f"Bearer {token}"}
            assert http.post("/auth/login", json={"username": "alice", "password": PASSWORD}).status_code == 200
            assert http.post("/auth/login", json={"username": "alice", "password": PASSWORD + "x"}).status_code == 401
            key = http.post("/auth/api-keys", headers=auth, json={"name": "ci"}).json()["key"]
            secrets.append(key)
            assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            assert http.get("/v1/models", headers={"x-api-key": key}).status_code == 200
            # Credentials put where they do not belong: in query strings, and a wrong key.
            http.get("/v1/models", params={"api_key": key, "token": token})
            wrong = key[:-4] + "abcd"
            secrets.append(wrong)
            assert http.get("/v1/models", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
            cid = http.post("/conversations", headers=auth).json()["id"]
            r = http.post(f"/conversations/{cid}/messages", headers=auth, json={"text": "hello"})
            assert r.status_code == 200
            share = http.post(f"/conversations/{cid}/shares", headers=auth, json={})
            assert share.status_code == 201, share.text
            link_token = share.json()["token"]
            secrets.append(link_token)
            assert http.get(f"/s/{link_token}").status_code == 200
            code, state = "sso-code-" + "q" * 40, "sso-state-" + "z" * 40
            secrets += [code, state]
            http.get("/auth/sso/callback", params={"code": code, "state": state})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    written = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
    assert "GET /v1/models" in written and "POST /auth/login" in written  # the access log was written
    for secret in secrets:
        lines = [line for line in written.splitlines() if secret in line]
        assert not lines, f"a secret is in the logs: {lines[:3]}"
