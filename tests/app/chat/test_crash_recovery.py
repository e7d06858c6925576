"""A real `chatloom serve` process killed with SIGKILL once its client has received N tokens of an
answer (N from 1 to 50), then restarted on the same data folder: the answer's stored text holds every
token the client received, it is `interrupted` on the first read (no sweep to wait for), and
continuing it finishes it. Then SIGTERM mid-answer: the process drains for shutdown_drain_s and exits,
the answer marked interrupted with its partial text.

Uses a small random-weight Llama written as a Hugging Face folder (loads at once): big enough that
an answer of 1,900 tokens streams for several seconds (the 2-layer tiny-random model now finishes it
before the kill), small enough to stay fast. With random weights an answer ends at its length limit
rather than at a natural stop, so "complete" here means it ran to its end: finish 'length'."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

from chatloom.app.chat.recovery import SHUT_DOWN

from app_testing import free_port, parse_sse

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "models"))
from tiny_checkpoints import hf_config, random_weights, write_hf_folder  # noqa: E402


def _model_folder(tmp: Path) -> Path:
    """8 layers of width 384 (about 70 MB in float32): a few milliseconds per token without kernels."""
    folder = tmp / "model"
    if not (folder / "config.json").exists():
        cfg = hf_config("llama", hidden_size=384, intermediate_size=1536, num_hidden_layers=8,
                        num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
        write_hf_folder(folder, cfg, random_weights(cfg))
    return folder
QUESTION = "Count from 1 to 300, one number per line, nothing else."


def _serve(tmp: Path, port: int) -> subprocess.Popen:
    config = tmp / "chatloom.toml"
    config.write_text("\n".join([
        "[server]", f'data_dir = "{tmp}"', f"port = {port}", 'log_level = "warning"',
        "[accounts]", 'jwt_secret = "crash-test-secret-0123456789abcdef0123"',
        "argon2_time_cost = 1", "argon2_memory_kib = 1024",
        "[sampling]", "temperature = 0.0", "max_tokens = 1500", "max_tokens_limit = 2000",
        "[recovery]", "stale_s = 60.0", "shutdown_drain_s = 1.0",
        "[engine]", "max_num_seqs = 4", "num_blocks = 256", "context_window = 2048",
        "[model]", f'name = "{_model_folder(tmp)}"',
        "[moderation]", 'mode = "off"', "[traffic]", 'default_tier = "pro"',
        # No chat tools: their definitions would take 1,200 of the 2,048-token window and shorten the answer.
        "[chat]", 'system_prompt = "You follow instructions exactly."', 'tools = ""']) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CHATLOOM_RUNTIME__KERNELS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "chatloom.cli", "serve", "--config", str(config)], cwd=tmp,
                            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"serve-{time.time():.0f}.log", "w"))
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "chatloom serve exited"
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("chatloom serve did not get ready")


def _stream_until(client: httpx.Client, method: str, url: str, body: dict, stop_after_s: float | None = None,
                  stop_after_tokens: int | None = None):
    """(time, text so far) after each token event; stops reading after stop_after_s of tokens or once
    stop_after_tokens token events have arrived. Returns them and the 'done' event (None if it stopped first)."""
    seen, text, first = [], "", None
    with client.stream(method, url, json=body) as r:
        assert r.status_code == 200, r.read()
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
            while "\n\n" in buf:
                block, buf = buf.split("\n\n", 1)
                for ev in parse_sse(block + "\n\n"):
                    if isinstance(ev.data, dict) and "token" in ev.data:
                        text += ev.data["token"]
                        now = time.monotonic()
                        first = first or now
                        seen.append((now, text))
                        if stop_after_tokens is not None and len(seen) >= stop_after_tokens:
                            return seen, None
                    elif isinstance(ev.data, dict) and ev.data.get("done"):
                        return seen, ev.data
            if stop_after_s is not None and first and time.monotonic() - first >= stop_after_s:
                return seen, None
    return seen, None


KILL_AFTER = (1, 7, 50)  # tokens the client has received when the server is killed


def test_sigkill_after_n_tokens_then_restart_and_continue(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = _serve(tmp_path, port)
    try:
        with httpx.Client(base_url=base, timeout=120) as c:
            token = c.post("/auth/signup", json={"username": "alice", "password": "correct horse"}).json()["token"]
        auth = {"Authorization": f"Bearer {token}"}
        for n in KILL_AFTER:
            with httpx.Client(base_url=base, timeout=120, headers=auth) as c:
                for attempt in range(8):  # the tiny model may end an answer (EOS) before the kill; ask again
                    cid = c.post("/conversations").json()["id"]
                    seen, done = _stream_until(c, "POST", f"/conversations/{cid}/messages",
                                               {"text": f"{QUESTION} ({n}, {attempt})", "max_tokens": 1900,
                                                "temperature": 0.3}, stop_after_tokens=n)
                    if done is None:
                        break
                assert done is None and len(seen) == n, f"every answer ended before {n} tokens"
                server.send_signal(signal.SIGKILL)  # while the stream is still open
                server.wait(10)
            received = seen[-1][1]

            server = _serve(tmp_path, port)
            with httpx.Client(base_url=base, timeout=120, headers=auth) as c:
                answer = c.get(f"/conversations/{cid}").json()["messages"][-1]  # the first read, no waiting
                assert answer["role"] == "assistant"
                assert answer["status"] == "interrupted" and answer["interrupted_reason"], (n, answer)
                saved = answer["text"]
                # Every token the client received (and possibly more the model wrote); nothing else.
                assert saved.startswith(received), (n, received, saved)
                print(f"\nkilled after {n} tokens: received {len(received)} chars, saved {len(saved)}")

                # Continue: the answer goes on from the saved text, in the same message, to its end.
                _, done = _stream_until(c, "POST", f"/conversations/{cid}/messages/{answer['id']}/continue",
                                        {"max_tokens": 16})
                assert done is not None and done["message_id"] == answer["id"]
                assert done["status"] in ("complete", "incomplete") and done["finish_reason"] in ("stop", "length"), done
                final = c.get(f"/conversations/{cid}").json()["messages"][-1]
                assert final["id"] == answer["id"] and final["status"] == done["status"]
                assert final["text"].startswith(saved) and final.get("interrupted_reason") is None

        with httpx.Client(base_url=base, timeout=120, headers=auth) as c:
            # SIGTERM mid-answer: drained for shutdown_drain_s (1 s), then interrupted, and the process exits.
            cid2 = c.post("/conversations").json()["id"]
            seen2, _ = _stream_until(c, "POST", f"/conversations/{cid2}/messages",
                                     {"text": QUESTION, "max_tokens": 1900}, stop_after_s=1.0)
        t0 = time.monotonic()
        server.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once it has shut down cleanly: the exit status is -SIGTERM.
        assert server.wait(30) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 20
        db = sqlite3.connect(tmp_path / "chatloom.db")
        status, finish, reason, text = db.execute(
            "SELECT status, finish_reason, interrupted_reason, text FROM messages WHERE "
            "conversation_id = ? AND role = 'assistant'", (cid2,)).fetchone()
        db.close()
        # Either it finished within the drain (the tiny model is fast), or it was interrupted with its
        # partial text; never left looking as if it were still being written.
        assert finish is not None and text.startswith(seen2[-1][1][:20])
        assert (status == "interrupted" and reason == SHUT_DOWN) or (status in ("complete", "incomplete")
                                                                     and reason is None), (status, reason)
        print(f"sigterm: the second answer ended {status} ({finish})")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
