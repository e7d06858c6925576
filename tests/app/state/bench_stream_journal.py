"""Client-side tokens/s of conversation answers over HTTP (uvicorn on loopback) on the embedded setup
(SQLite), with a scripted backend: unpaced (one burst per answer) and paced at 10 ms a token.

    PYTHONPATH=. CHATLOOM_KERNELS=0 python tests/app/state/bench_stream_journal.py [TOKENS]

Prints one line per case: tokens/s (median of 3 runs after a warm-up) and the inter-token gaps."""
from __future__ import annotations

import asyncio
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parents[1]))  # app_testing, traffic_testing
from chatloom.app.main import create_app  # noqa: E402
from chatloom.bench.latency import LoopbackServer  # noqa: E402
from app_testing import make_settings  # noqa: E402
from traffic_testing import ScriptedBackend  # noqa: E402


async def _one(client: httpx.AsyncClient, headers: dict, tokens: int) -> tuple[float, list[float]]:
    cid = (await client.post("/conversations", headers=headers)).json()["id"]
    arrivals: list[float] = []
    start = time.perf_counter()
    async with client.stream("POST", f"/conversations/{cid}/messages", headers=headers,
                             json={"text": "go", "max_tokens": tokens}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                data = json.loads(line[5:])
                if isinstance(data, dict) and "error" in data:
                    raise SystemExit(str(data))
                if isinstance(data, dict) and data.get("token"):
                    arrivals.append(time.perf_counter())
    return start, arrivals


async def _case(url: str, headers: dict, users: int, tokens: int) -> tuple[float, float, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        out = await asyncio.gather(*(_one(client, headers, tokens) for _ in range(users)))
    start, end = min(s for s, _ in out), max(a[-1] for _, a in out)
    gaps = sorted(b - a for _, arr in out for a, b in zip(arr, arr[1:]))
    return sum(len(a) for _, a in out) / (end - start), statistics.mean(gaps) * 1000, gaps[int(len(gaps) * 0.99)] * 1000


def main(tokens: int) -> None:
    for delay in (0.0, 0.01):
        with tempfile.TemporaryDirectory() as tmp:
            backend = ScriptedBackend([f" w{i}" for i in range(tokens)], delay_s=delay)
            settings = make_settings(tmp, moderation={"mode": "off"}, sampling={"max_tokens_limit": tokens + 10}, server={"log_level": "warning"})
            with LoopbackServer(create_app(settings, backend)) as server:
                r = httpx.post(server.url + "/auth/signup", json={"username": "alice", "password": "correct horse"})
                headers = {"Authorization": f"Bearer {r.json()['token']}"}
                db = sqlite3.connect(f"{tmp}/chatloom.db")  # eight answers at once: the pro tier
                db.execute("UPDATE users SET tier = 'pro'")
                db.commit()
                db.close()
                for users in (1, 8):
                    asyncio.run(_case(server.url, headers, users, tokens))  # warm-up
                    runs = [asyncio.run(_case(server.url, headers, users, tokens)) for _ in range(3)]
                    print(f"pace {delay * 1000:.0f} ms/token, {users} answer(s) at once: "
                          f"{statistics.median(r[0] for r in runs):,.0f} tokens/s (mean gap "
                          f"{statistics.median(r[1] for r in runs):.2f} ms, p99 {statistics.median(r[2] for r in runs):.2f} ms)",
                          flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 500)
