"""`chatloom bench streams`: many concurrent SSE streams through one gateway process.

Three processes, so each one's CPU is its own:

- a scripted replica (`streams_backend.py`): an OpenAI-compatible server that streams a token every
  `interval` to each request, starting at a random phase, and writes into each token's text the
  `time.monotonic_ns()` at which the token left it;
- the gateway: `chatloom serve --replica <the scripted replica>` (uvicorn, HTTP/1.1, loopback), the
  product as deployed in front of replicas: authentication by API key, quotas, admission, the
  output moderation check, metering, the router, the OpenAI-compatible SSE framing. Tier quotas and
  the admission limit are raised for the run (environment), and moderation's holdback is 0, so no
  piece is held back on purpose and what is timed is the gateway's own cost;
- a client (`stream_readers.py`) opening all N streams at once on POST /v1/chat/completions with
  stream=true and reading each token's stamp when its bytes arrive.

Gap = client arrival - replica send, both on the machine's one CLOCK_MONOTONIC, so it is the
token's trip replica -> gateway -> client, including the client's own receive lag. That lag is
measured apart (the client's event-loop lateness), and a direct round (the same client on the
replica itself, no gateway) gives the floor the gateway's figures should be read against.

Gateway CPU is utime + stime of its process (all threads) from /proc/PID/stat, read before the
client starts and after it ends, divided by the tokens the client received; it includes the
requests' setup (authentication, admission, the router's placement), which is part of serving a
stream. A stream is starved when it got no token for more than 1 s while another stream did.
"""
from __future__ import annotations

import bisect
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from chatloom.bench.server_process import free_port

STARVED_S = 1.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class StreamsConfig:
    streams: int = 1000
    tokens: int = 200
    interval_ms: float = 50.0
    direct: bool = True  # also run the client against the replica itself, for the floor
    seed: int = 0
    moderation: str = "lexicon"  # the gateway's moderation.mode (off: to see what the output check costs)
    timeout_s: float = 600.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/PID/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def percentiles_ms(values_ns: list[int]) -> dict:
    """p50, p90, p99 and max in milliseconds (nearest rank)."""
    if not values_ns:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    xs = sorted(values_ns)

    def rank(q: float) -> float:
        return round(xs[min(len(xs) - 1, max(0, int(q * len(xs) + 0.5) - 1))] / 1e6, 3)

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99), "max": round(xs[-1] / 1e6, 3)}


def starved_streams(arrivals: list[list[int]], limit_ns: int) -> int:
    """Streams with a silence longer than `limit_ns` between two of their tokens while another stream
    received one."""
    everyone = sorted(t for times in arrivals for t in times)
    starved = 0
    for times in arrivals:
        for a, b in zip(times, times[1:]):
            # The stream's own arrivals never fall strictly inside its gap between consecutive tokens.
            if b - a > limit_ns and bisect.bisect_left(everyone, b) - bisect.bisect_right(everyone, a) > 0:
                starved += 1
                break
    return starved


def summarize(raw: dict, tokens: int) -> dict:
    """The client's raw records as the report's figures (CPU is added by the caller)."""
    streams = raw["streams"]
    errors = [s["error"] for s in streams if s["error"]]
    complete = sum(1 for s in streams if not s["error"] and s["seqs"] == list(range(tokens)))
    gaps = [g for s in streams for g in s["gaps_ns"]]
    return {
        "streams": len(streams), "completed": complete, "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "tokens_received": len(gaps),
        "wall_s": round((raw["ended_ns"] - raw["started_ns"]) / 1e9, 3),
        "gap_ms": percentiles_ms(gaps),
        "client_loop_lag_ms": percentiles_ms(raw["loop_lag_ns"]),
        "starved_streams": starved_streams([s["arrivals_ns"] for s in streams], int(STARVED_S * 1e9)),
    }


class _Processes:
    """Children started by the run, all stopped at its end whatever happens."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.children: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.children.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.children:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.children:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _gateway_env(folder: Path, config: StreamsConfig) -> dict[str, str]:
    big = str(10 ** 12)
    # The caller's own CHATLOOM_ settings (a database URL, Redis, tiers) would change what is measured.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("CHATLOOM_") or k.startswith("CHATLOOM_RUNTIME__")}
    env = {**inherited, "CHATLOOM_SERVER__DATA_DIR": str(folder / "data"), "CHATLOOM_MODEL__NAME": "scripted",
           "CHATLOOM_SERVER__LOG_LEVEL": "warning", "CHATLOOM_MODERATION__HOLDBACK_TOKENS": "0",
           "CHATLOOM_MODERATION__MODE": config.moderation,
           "CHATLOOM_TRAFFIC__ADMISSION_MAX_RUNNING": str(config.streams + 8),
           "CHATLOOM_ENGINE__MAX_NUM_SEQS": str(config.streams + 8),
           "CHATLOOM_SAMPLING__MAX_TOKENS_LIMIT": str(max(4096, config.tokens)),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH")]))}
    for tier in ("FREE", "PLUS", "PRO"):
        env.update({f"CHATLOOM_TIER_{tier}_TOKENS_PER_MINUTE": big, f"CHATLOOM_TIER_{tier}_TOKENS_PER_DAY": big,
                    f"CHATLOOM_TIER_{tier}_REQUESTS_PER_MINUTE": big,
                    f"CHATLOOM_TIER_{tier}_MAX_CONCURRENT": str(config.streams + 8),
                    f"CHATLOOM_TIER_{tier}_MAX_TOKENS": str(max(4096, config.tokens))})
    return env


def _wait_ready(url: str, proc: subprocess.Popen, headers: dict, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with status {proc.returncode} before it was ready (log: {log})")
        try:
            if httpx.get(url, headers=headers, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not ready after {timeout_s:.0f} s (log: {log})")


def _client(procs: _Processes, env: dict, port: int, config: StreamsConfig, api_key: str | None,
            direct: bool, watch: list[int]) -> tuple[dict, dict[int, float]]:
    """Run one client round; its raw records and the CPU seconds each watched process spent meanwhile."""
    argv = [sys.executable, "-m", "chatloom.bench.stream_readers", "--port", str(port), "--streams",
            str(config.streams), "--tokens", str(config.tokens)]
    argv += ["--direct"] if direct else ["--api-key", api_key or ""]
    before = {pid: cpu_seconds(pid) for pid in watch}
    out = procs.folder / f"client-{'direct' if direct else 'gateway'}.json"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.PIPE)
        procs.children.append(proc)
        _, err = proc.communicate(timeout=config.timeout_s)
    spent = {pid: cpu_seconds(pid) - before[pid] for pid in watch}
    if proc.returncode != 0:
        raise RuntimeError(f"the stream client failed: {err.decode(errors='replace').strip()[-500:]}")
    return json.loads(out.read_text()), spent


def _cpu_figures(seconds: float, tokens: int) -> dict:
    return {"cpu_s": round(seconds, 3), "cpu_us_per_token": round(seconds / tokens * 1e6, 1) if tokens else None}


def run_streams(config: StreamsConfig) -> dict:
    """Start the replica and the gateway, run the client rounds, stop everything; the report."""
    with tempfile.TemporaryDirectory(prefix="chatloom-streams-") as tmp:
        folder = Path(tmp)
        procs = _Processes(folder)
        try:
            return _run(config, folder, procs)
        finally:
            procs.stop()


def _run(config: StreamsConfig, folder: Path, procs: _Processes) -> dict:
    env = _gateway_env(folder, config)
    replica_port, gateway_port = free_port(), free_port()
    replica = procs.start("replica", [sys.executable, "-m", "chatloom.bench.streams_backend", "--port",
                                      str(replica_port), "--interval-ms", str(config.interval_ms),
                                      "--seed", str(config.seed)], env)
    _wait_ready(f"http://127.0.0.1:{replica_port}/health", replica, {}, 30, folder / "replica.log")
    cli = [sys.executable, "-m", "chatloom.cli"]
    made = subprocess.run(cli + ["keys", "create", "--user", "bench", "--create-user", "--name", "streams"],
                          env=env, capture_output=True, text=True, timeout=120)
    if made.returncode != 0:
        raise RuntimeError(f"could not create the bench's API key: {made.stderr.strip()[-500:]}")
    api_key = made.stdout.strip().splitlines()[-1]
    gateway = procs.start("gateway", cli + ["serve", "--port", str(gateway_port), "--replica",
                                            f"http://127.0.0.1:{replica_port}"], env)
    headers = {"Authorization": f"Bearer {api_key}"}
    _wait_ready(f"http://127.0.0.1:{gateway_port}/v1/models", gateway, headers, 120, folder / "gateway.log")
    warm = httpx.post(f"http://127.0.0.1:{gateway_port}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "scripted", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2})
    if warm.status_code != 200:
        raise RuntimeError(f"the gateway's warm-up request answered {warm.status_code}: {warm.text[:300]}")
    result: dict = {"config": {"streams": config.streams, "tokens_per_stream": config.tokens,
                               "interval_ms": config.interval_ms, "seed": config.seed,
                               "moderation": config.moderation,
                               "path": "POST /v1/chat/completions stream=true (HTTP/1.1, uvicorn)",
                               "cpus": os.cpu_count()}}
    if config.direct:
        raw, spent = _client(procs, env, replica_port, config, None, True, [replica.pid])
        result["direct"] = {**summarize(raw, config.tokens),
                            "replica": _cpu_figures(spent[replica.pid], sum(len(s["seqs"]) for s in raw["streams"]))}
    raw, spent = _client(procs, env, gateway_port, config, api_key, False, [gateway.pid, replica.pid])
    summary = summarize(raw, config.tokens)
    result["gateway"] = {**summary, **_cpu_figures(spent[gateway.pid], summary["tokens_received"]),
                         "replica": _cpu_figures(spent[replica.pid], summary["tokens_received"])}
    result["gateway"]["metered_requests"] = _metered(f"http://127.0.0.1:{gateway_port}", headers,
                                                     summary["completed"])
    if summary["errors"]:  # why, from the gateway's own log (the folder goes with the run)
        lines = (folder / "gateway.log").read_text(errors="replace").splitlines()
        result["gateway"]["log_errors"] = [line[:300] for line in lines if " ERROR " in line or "Error" in line][-10:]
    p99 = summary["gap_ms"]["p99"]
    result["target"] = {"p99_gap_ms": 20.0, "met": p99 is not None and p99 < 20.0 and summary["errors"] == 0
                        and summary["starved_streams"] == 0}
    return result


def _metered(url: str, headers: dict, completed: int, timeout_s: float = 30.0) -> int | None:
    """Requests the gateway metered for the round (the warm-up left out), read from GET /usage once
    every completed stream is there or the timeout has passed (metering ends after the stream)."""
    deadline = time.monotonic() + timeout_s
    metered = None
    while True:
        r = httpx.get(f"{url}/usage", headers=headers, timeout=60)
        if r.status_code != 200:
            return None
        metered = sum(row["requests"] for row in r.json()["data"]) - 1
        if metered >= completed or time.monotonic() > deadline:
            return metered
        time.sleep(0.2)


def format_table(result: dict) -> str:
    """The rounds side by side."""
    rows = [("round", "streams", "done", "errors", "starved", "gap p50", "p90", "p99", "max", "loop lag p99",
             "gateway CPU us/token")]
    for name in ("direct", "gateway"):
        r = result.get(name)
        if r is None:
            continue
        g = r["gap_ms"]
        rows.append((name, r["streams"], r["completed"], r["errors"], r["starved_streams"], g["p50"], g["p90"],
                     g["p99"], g["max"], r["client_loop_lag_ms"]["p99"], r.get("cpu_us_per_token", "-")))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in rows)
