"""`chatloom bench batch`: a large batch beside interactive users, on one server, in one run.

The app runs over the local engine behind uvicorn on loopback (a throwaway SQLite database; the free tier's
limits raised so quotas do not pace the work). Three phases, in this order, on the same warm engine:

1. interactive alone: `users` users chat (streamed /v1/chat/completions, `turns` turns each, `think_s`
   between turns): their TTFT, and the output tokens per second they used;
2. batch alone: a batch of `requests` chat requests run to its end: its output tokens per second, the
   capacity of the idle server for batch work;
3. together: the same batch again while the same users chat for as long as it runs: their TTFT, and the
   batch's output tokens per second.

With `rounds` > 1 the requests are split into that many batches and the three phases repeat once per
batch, so that the baseline phases are measured in the same minutes as the phase they are compared with
(on a shared machine the load moves from one minute to the next); the figures are over all rounds. Each
user's turns go down one list of prompts over all phases, so the baseline asks as many prompts it has not
asked before as the phase beside the batch does. The bench asks for the batch's status every `POLL_S`: its
own requests load the gateway in the batch phases only. The bench's client (the users and the batch's
owner) runs in a process of its own: in the server's process its HTTP and JSON work would compete with the
gateway and the engine for the interpreter lock, and its readings would count its own waits for it.

The capacity interactive traffic leaves idle is (2) minus what (1) used. Targets (from the issue): TTFT p90
in (3) at most 1.15 x (1), and the batch's throughput in (3) at least 70 % of the idle capacity.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from chatloom.bench.serve import make_prompts, one_request, percentiles

TTFT_RATIO_MAX = 1.15
IDLE_SHARE_MIN = 0.70
BIG = 10 ** 12
# How often the bench asks whether a batch has ended: its requests share the gateway with the users during
# the batch phases only, so they are kept few (a finer end time is not worth load the baseline never sees).
POLL_S = 0.25
PROMPTS_PER_USER = 1024


@dataclass
class Interactive:
    ttfts: list[float] = field(default_factory=list)
    output_tokens: int = 0
    requests: int = 0
    failed: int = 0
    seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)  # failed requests by status

    def summary(self) -> dict:
        return {"requests": self.requests, "failed": self.failed, "errors": self.errors,
                "ttft_ms": percentiles(self.ttfts),
                "output_tokens": self.output_tokens, "seconds": round(self.seconds, 3),
                "output_tokens_per_s": round(self.output_tokens / self.seconds, 3) if self.seconds else None}


async def _chat(client: httpx.AsyncClient, headers: dict, model: str, prompts: list[str], max_tokens: int,
                think_s: float, keep_going, out: Interactive, asked: list[int], user: int) -> None:
    """One user: a turn after another while `keep_going(turn)` says so. `asked[user]` counts the user's
    turns over every phase, and each turn asks the next prompt of the user's one random sequence: the
    baseline does not ask the same few prompts round after round (warm in the prefix cache) while the
    phase beside the batch goes further down the list."""
    turn = 0
    # The users start one after another across a pause: all of them at once would read their prompts in the
    # same steps, a burst that is an eighth of a short baseline's turns and a small part of a long phase's.
    await asyncio.sleep(think_s * user / len(asked))
    while keep_going(turn):
        prompt = prompts[asked[user] % len(prompts)]
        asked[user] += 1
        result = await one_request(client, "/v1/chat/completions", headers, model, prompt, max_tokens)
        out.requests += 1
        if result.ok:
            out.ttfts.append(result.ttft)
            out.output_tokens += result.output_tokens
        else:
            out.failed += 1
            key = f"{result.status} {result.error[:80]}".strip()
            out.errors[key] = out.errors.get(key, 0) + 1
        turn += 1
        await asyncio.sleep(think_s)


async def _users(client, accounts: list[dict], model: str, max_tokens: int, think_s: float, keep_going,
                 asked: list[int] | None = None) -> Interactive:
    out = Interactive()
    asked = asked if asked is not None else [0] * len(accounts)
    start = time.perf_counter()
    await asyncio.gather(*(_chat(client, headers, model, make_prompts(PROMPTS_PER_USER, seed=i), max_tokens, think_s,
                                 keep_going, out, asked, i)
                           for i, headers in enumerate(accounts)))
    out.seconds = time.perf_counter() - start
    return out


async def _batch(client: httpx.AsyncClient, headers: dict, model: str, requests: int, max_tokens: int,
                 seed: int) -> dict:
    lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "messages": [{"role": "user", "content": prompt}],
                                  "max_tokens": max_tokens, "temperature": 0}})
             for i, prompt in enumerate(make_prompts(requests, seed=seed))]
    r = await client.post("/v1/files", headers=headers, files={"file": ("bench.jsonl", "\n".join(lines).encode())},
                          data={"purpose": "batch"})
    r.raise_for_status()
    engine_before = await _engine_seconds(client)
    start = time.perf_counter()
    r = await client.post("/v1/batches", headers=headers, json={"input_file_id": r.json()["id"],
                                                                "endpoint": "/v1/chat/completions",
                                                                "completion_window": "24h"})
    r.raise_for_status()
    batch_id = r.json()["id"]
    while True:
        batch = (await client.get(f"/v1/batches/{batch_id}", headers=headers)).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            break
        await asyncio.sleep(POLL_S)
    seconds = time.perf_counter() - start
    engine = _spent(engine_before, await _engine_seconds(client))
    tokens = 0
    if batch.get("output_file_id"):
        content = await client.get(f"/v1/files/{batch['output_file_id']}/content", headers=headers)
        tokens = sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in content.text.splitlines())
    counts = batch["request_counts"]
    return {"status": batch["status"], "completed": counts["completed"], "failed": counts["failed"],
            "output_tokens": tokens, "seconds": round(seconds, 3), "output_tokens_per_s": round(tokens / seconds, 3),
            "engine_seconds": engine}


async def _engine_seconds(client: httpx.AsyncClient) -> dict[str, float]:
    """The engine's step seconds so far by what the steps carried (chatloom:engine_step_seconds), and the
    wall clock: two readings give a phase's foreground, background and interrupted time."""
    from prometheus_client.parser import text_string_to_metric_families

    r = await client.get("/metrics")
    r.raise_for_status()
    found = {"wall": time.perf_counter()}
    for family in text_string_to_metric_families(r.text):
        if family.name == "chatloom:engine_step_seconds":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    found[sample.labels["kind"]] = found.get(sample.labels["kind"], 0.0) + sample.value
    return found


def _spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}


def _tiers_file(folder: Path) -> str:
    """The free tier with limits no run reaches: the bench measures capacity, not quotas."""
    path = folder / "tiers.toml"
    path.write_text(f"[free]\ntokens_per_minute = {BIG}\ntokens_per_day = {BIG}\nrequests_per_minute = {BIG}\n"
                    f"max_concurrent = 100000\nmax_tokens = 4096\n")
    return str(path)


def _add(total: Interactive, part: Interactive) -> None:
    total.ttfts += part.ttfts
    total.output_tokens += part.output_tokens
    total.requests += part.requests
    total.failed += part.failed
    for key, n in part.errors.items():
        total.errors[key] = total.errors.get(key, 0) + n
    total.seconds += part.seconds


def _merge(parts: list[dict]) -> dict:
    """The batches of every round as one: counts and tokens added, throughput over their time together."""
    merged = {"status": "completed" if all(p["status"] == "completed" for p in parts) else "incomplete"}
    for key in ("completed", "failed", "output_tokens", "seconds"):
        merged[key] = round(sum(p[key] for p in parts), 3)
    merged["output_tokens_per_s"] = round(merged["output_tokens"] / merged["seconds"], 3)
    kinds = {k for p in parts for k in p["engine_seconds"]}
    merged["engine_seconds"] = {k: round(sum(p["engine_seconds"].get(k, 0.0) for p in parts), 3)
                                for k in sorted(kinds)}
    return merged


async def _run(url: str, model: str, requests: int, rounds: int, users: int, turns: int, max_tokens: int,
               batch_max_tokens: int, think_s: float, seed: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        accounts = []
        for i in range(users + 1):
            r = await client.post("/auth/signup", json={"username": f"bench{i}", "password": "correct horse"})
            r.raise_for_status()
            accounts.append({"Authorization": f"Bearer {r.json()['token']}"})
        owner, chatters = accounts[0], accounts[1:]
        # Warm-up: one request of each kind, so neither measured phase pays for first-use costs.
        await _users(client, chatters[:1], model, max_tokens, 0.0, lambda turn: turn < 1)
        await _batch(client, owner, model, 2, batch_max_tokens, seed + 1)

        alone, together = Interactive(), Interactive()
        asked = [0] * users  # each user's turns so far, over all phases
        batch_alone, batch_together, users_engine = [], [], []
        for r in range(rounds):  # the phases alternate, so each sees the machine's load of the same minutes
            share = requests // rounds + (1 if r < requests % rounds else 0)
            before = await _engine_seconds(client)
            _add(alone, await _users(client, chatters, model, max_tokens, think_s, lambda turn: turn < turns, asked))
            users_engine.append(_spent(before, await _engine_seconds(client)))
            batch_alone.append(await _batch(client, owner, model, share, batch_max_tokens, seed + 2 + 2 * r))
            running = asyncio.create_task(_batch(client, owner, model, share, batch_max_tokens, seed + 3 + 2 * r))
            _add(together, await _users(client, chatters, model, max_tokens, think_s,
                                        lambda turn: turn < turns or not running.done(), asked))
            batch_together.append(await running)
    batch_alone, batch_together = _merge(batch_alone), _merge(batch_together)
    idle = batch_alone["output_tokens_per_s"] - (alone.output_tokens / alone.seconds)
    p90_alone, p90_together = alone.summary()["ttft_ms"]["p90"], together.summary()["ttft_ms"]["p90"]
    ratio = round(p90_together / p90_alone, 3) if p90_alone and p90_together else None
    share = round(batch_together["output_tokens_per_s"] / idle, 3) if idle > 0 else None
    return {"model": model, "requests": requests, "rounds": rounds, "users": users, "turns": turns,
            "max_tokens": max_tokens,
            "batch_max_tokens": batch_max_tokens, "think_s": think_s,
            "interactive_alone": alone.summary(), "batch_alone": batch_alone,
            "together": {"interactive": together.summary(), "batch": batch_together},
            "idle_capacity_tokens_per_s": round(idle, 3), "ttft_p90_ratio": ratio, "batch_share_of_idle": share,
            "engine_time": _engine_time(users_engine, batch_alone, batch_together),
            "targets": {"ttft_p90_ratio_max": TTFT_RATIO_MAX, "batch_share_of_idle_min": IDLE_SHARE_MIN,
                        "met": ratio is not None and share is not None and ratio <= TTFT_RATIO_MAX
                        and share >= IDLE_SHARE_MIN}}


def _engine_time(users_engine: list[dict], batch_alone: dict, batch_together: dict) -> dict:
    """The same phases in engine time. On an engine whose step time grows with each sequence (a CPU), the
    users' tokens cost more engine time apiece than the batch's (their steps are small), so the batch
    alone minus what the users used, in tokens a second, is more than the time they leave can give. Here
    the time left is the phase's wall time minus its steps with a user's sequence in them, and the batch's
    share is its tokens over what the batch alone made in that much time."""
    users = {k: sum(e.get(k, 0.0) for e in users_engine) for k in ("wall", "foreground")}
    t = batch_together["engine_seconds"]
    left = t["wall"] - t.get("foreground", 0.0)
    rate = batch_alone["output_tokens_per_s"]
    capacity = rate * left
    return {
        "interactive_alone_foreground_share": round(users["foreground"] / users["wall"], 3) if users["wall"] else None,
        "together_foreground_share": round(t.get("foreground", 0.0) / t["wall"], 3) if t["wall"] else None,
        "together_seconds_left_by_interactive": round(left, 3),
        "together_background_s": t.get("background", 0.0), "together_interrupted_s": t.get("interrupted", 0.0),
        "batch_share_of_time_left": round(batch_together["output_tokens"] / capacity, 3) if capacity > 0 else None}


def _client(url: str, *args) -> dict:
    """The phases' client, in the process `_in_own_process` starts."""
    return asyncio.run(_run(url, *args))


def _in_own_process(*args) -> dict:
    """`_client(*args)` in a fresh interpreter (spawned, not forked: the server's threads and the engine's
    state stay behind)."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_client, *args).result()


def run_batch_bench(loaded, requests: int = 1000, users: int = 4, turns: int = 8, max_tokens: int = 32,
                    batch_max_tokens: int = 32, think_s: float = 0.5, seed: int = 0, engine_config=None,
                    settings: dict | None = None, rounds: int = 1) -> dict:
    """The three phases on `loaded` (a LoadedModel); `settings`: groups of the settings tree to change."""
    from chatloom.app.main import create_app
    from chatloom.bench.latency import LoopbackServer
    from chatloom.serving import LocalBackend
    from chatloom.settings import Settings

    with tempfile.TemporaryDirectory(prefix="chatloom-bench-batch-") as work:
        groups = {"server": {"data_dir": work, "metrics_public": True},
                  "traffic": {"tiers_file": _tiers_file(Path(work))},
                  "accounts": {"argon2_time_cost": 1, "argon2_memory_kib": 1024},
                  "sampling": {"max_tokens": max_tokens}}
        if engine_config is not None:  # the admission queue's slots follow the engine's
            groups["engine"] = {"max_num_seqs": engine_config.max_num_seqs}
        for group, values in (settings or {}).items():
            groups.setdefault(group, {}).update(values)
        backend = LocalBackend(loaded, engine_config=engine_config)
        asyncio.run(backend.start())
        try:
            chosen = Settings(**groups)
            with LoopbackServer(create_app(chosen, backend)) as server:
                result = _in_own_process(server.url, backend.default_model, requests, rounds, users, turns,
                                         max_tokens, batch_max_tokens, think_s, seed)
            return {**result, "batch_settings": chosen.batch.model_dump(),
                    "max_num_seqs": chosen.traffic.admission_max_running or chosen.engine.max_num_seqs}
        finally:
            asyncio.run(backend.close())


def format_table(result: dict) -> str:
    alone, together = result["interactive_alone"], result["together"]["interactive"]
    rows = [("", "interactive alone", "batch alone", "together"),
            ("interactive TTFT p90 (ms)", alone["ttft_ms"]["p90"], "", together["ttft_ms"]["p90"]),
            ("interactive requests", alone["requests"], "", together["requests"]),
            ("interactive output tok/s", alone["output_tokens_per_s"], "", together["output_tokens_per_s"]),
            ("batch output tok/s", "", result["batch_alone"]["output_tokens_per_s"],
             result["together"]["batch"]["output_tokens_per_s"]),
            ("batch seconds", "", result["batch_alone"]["seconds"], result["together"]["batch"]["seconds"])]
    lines = [f"{a:<28}{b!s:>20}{c!s:>16}{d!s:>16}" for a, b, c, d in rows]
    lines.append(f"idle capacity {result['idle_capacity_tokens_per_s']} tok/s; "
                 f"TTFT p90 ratio {result['ttft_p90_ratio']} "
                 f"(target <= {TTFT_RATIO_MAX}); batch share of idle {result['batch_share_of_idle']} "
                 f"(target >= {IDLE_SHARE_MIN}); targets met: {result['targets']['met']}")
    e = result["engine_time"]
    lines.append(f"engine time with a user's sequence: {e['interactive_alone_foreground_share']} of the users' "
                 f"phase, {e['together_foreground_share']} beside the batch; batch share of the time left "
                 f"{e['batch_share_of_time_left']} (background steps {e['together_background_s']} s, "
                 f"stopped part-way {e['together_interrupted_s']} s, of "
                 f"{e['together_seconds_left_by_interactive']} s)")
    return "\n".join(lines)
