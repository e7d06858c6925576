"""`chatloom bench sizes`: chatloom, llama-server and vLLM side by side on the same weights.

Each server runs alone, one after the other (server_process.py starts, samples and stops it), on the
same GGUF file (vLLM: the Hugging Face folder of the same weights), and gets the same requests, every
one a streamed, greedy chat request with `ignore_eos`, so each produces exactly `max_tokens` tokens:

- one in flight: TPOT p50 and the TTFT of `short_prompt`-token prompts; one `long_prompt`-token prompt
  for its TTFT (prefill tokens/s) and its TPOT at that context;
- `in_flight` at once: a chat workload whose conversations have `history`-token histories: output
  tokens/s and TTFT p50/p90;
- one in flight again beside `neighbours` busy-loop processes: TPOT p50, and over the quiet one;
- resident memory after load and at the peak of the run, and the time from the spawn to the first
  answered request;
- the memory roofline: a decode step at batch 1 reads every weight once, so the file's weight bytes
  per step over this machine's read bandwidth is the fastest a step can be; each server's share of it
  is that bound over its TPOT.

Every prompt starts with its own words, so no server answers one from a prefix cache filled by another
request. chatloom runs as `chatloom replica` (the engine's own OpenAI face, as llama-server is llama.cpp's),
with its defaults. A server that is not there (no llama-server binary, vLLM not importable, no Hugging
Face folder) is skipped with a note in the JSON.
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from chatloom.bench.busy import busy_neighbours
from chatloom.bench.serve import Result, one_request, percentiles
from chatloom.bench.server_process import ServerProcess, free_port

SERVERS = ("chatloom", "llama-server", "vllm")
# The measurements a plan can run: one in flight with short prompts, the long prompt, the in-flight
# chat workload, and one in flight beside busy neighbours.
PHASES = ("short", "long", "in_flight", "busy")
TEXT = Path(__file__).parent / "texts" / "public_domain.txt"
IGNORE_EOS = {"ignore_eos": True}


@dataclass(frozen=True)
class SizesPlan:
    """How much each measurement asks of a server."""

    max_tokens: int = 64
    short_prompt: int = 100
    long_prompt: int = 4000
    tpot_requests: int = 3
    chat_requests: int = 16
    in_flight: int = 8
    history: tuple[int, int] = (1000, 3000)
    busy_requests: int = 2
    neighbours: int = 1
    ready_timeout_s: float = 1800.0
    phases: tuple[str, ...] = PHASES  # which of PHASES run; the others' figures are None

    def __post_init__(self) -> None:
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown or not self.phases:
            raise ValueError(f"unknown phase {unknown[0]!r}: use {', '.join(PHASES)}" if unknown
                             else f"no phase to run: use {', '.join(PHASES)}")

    def context_tokens(self) -> int:
        """The context a server is started with: every chat conversation at once, or the long prompt."""
        chat = self.in_flight * (self.history[1] + self.max_tokens + 256)
        return -(-max(chat, self.long_prompt + self.max_tokens + 256) // 256) * 256

    def sequence_tokens(self) -> int:
        """The longest one sequence gets: vLLM's `--max-model-len` is per sequence, not the whole cache."""
        longest = max(self.history[1], self.long_prompt) + self.max_tokens + 256
        return -(-longest // 256) * 256


# The shape of the run on a model small enough for the tests (figures mean nothing there).
QUICK = SizesPlan(max_tokens=4, short_prompt=16, long_prompt=160, tpot_requests=2, chat_requests=8, in_flight=8,
                  history=(40, 120), busy_requests=1, ready_timeout_s=600.0)


# -- prompts -------------------------------------------------------------------------------------------

class Texts:
    """Prompts of about n tokens of the model's own tokenizer: words of a public-domain text in a seeded
    random order, each prompt led by its own number so that no two share a prefix."""

    def __init__(self, tokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.words = TEXT.read_text().split()
        self.rng = random.Random(seed)
        self.count = 0

    def text(self, n: int) -> str:
        self.count += 1
        lead = f"Note {self.count} ({self.rng.randrange(10**6)}):"
        words = [lead]
        while True:
            words.extend(self.rng.choice(self.words) for _ in range(max(8, n // 2)))
            ids = self.tokenizer.encode(" ".join(words))
            if len(ids) >= n:
                return self.tokenizer.decode(ids[:n]).strip()

    def conversation(self, total: int) -> list[dict]:
        """User and assistant turns of 100-300 tokens adding up to about `total`, ending with a user turn."""
        messages: list[dict] = []
        left = total
        while left > 0:
            n = min(left, self.rng.randint(100, 300))
            role = "user" if len(messages) % 2 == 0 else "assistant"
            messages.append({"role": role, "content": self.text(max(n, 4))})
            left -= n
        if messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": self.text(20)})
        return messages


# -- measurements on one running server ------------------------------------------------------------------

def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 2)


def _p50(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


async def _one_at_a_time(client, url, model, prompts, max_tokens) -> list[Result]:
    return [await one_request(client, url, {}, model, p, max_tokens, IGNORE_EOS) for p in prompts]


async def _measure(server: ServerProcess, model: str, plan: SizesPlan, texts: Texts) -> dict:
    url = server.base_url + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=plan.in_flight + 2)
    async with httpx.AsyncClient(timeout=plan.ready_timeout_s, limits=limits) as client:
        # A warm-up request of the short kind first: some servers build their paths on first use.
        await _one_at_a_time(client, url, model, [texts.text(plan.short_prompt)], plan.max_tokens)
        # The prompts are drawn whatever runs, so a phase's prompts do not depend on the phases before it.
        short_prompts = [texts.text(plan.short_prompt) for _ in range(plan.tpot_requests)]
        long_prompt = texts.text(plan.long_prompt)
        chats = [texts.conversation(texts.rng.randint(*plan.history)) for _ in range(plan.chat_requests)]
        busy_prompts = [texts.text(plan.short_prompt) for _ in range(plan.busy_requests)]
        quiet = await _one_at_a_time(client, url, model, short_prompts, plan.max_tokens) \
            if "short" in plan.phases else []
        long = (await _one_at_a_time(client, url, model, [long_prompt], plan.max_tokens))[0] \
            if "long" in plan.phases else None
        limit = asyncio.Semaphore(plan.in_flight)

        async def chat(messages: list[dict]) -> Result:
            async with limit:
                return await one_request(client, url, {}, model, messages, plan.max_tokens, IGNORE_EOS)

        answers, chat_s = [], 0.0
        if "in_flight" in plan.phases:
            t0 = time.perf_counter()
            answers = await asyncio.gather(*(chat(m) for m in chats))
            chat_s = time.perf_counter() - t0
        busy = []
        if "busy" in plan.phases:
            with busy_neighbours(plan.neighbours):
                busy = await _one_at_a_time(client, url, model, busy_prompts, plan.max_tokens)
    longs = [long] if long is not None else []
    failed = [r for r in [*quiet, *longs, *answers, *busy] if not r.ok]
    long_ok = long is not None and long.ok
    tpot = _p50([r.tpot for r in quiet if r.ok and r.tpot is not None])
    busy_tpot = _p50([r.tpot for r in busy if r.ok and r.tpot is not None])
    done = [r for r in answers if r.ok]
    ttfts = percentiles([r.ttft for r in done])
    return {
        "one_in_flight": {
            "tpot_p50_ms": _ms(tpot),
            "short_prompt_tokens": _p50([r.prompt_tokens for r in quiet if r.ok]),
            "short_prompt_ttft_p50_ms": _ms(_p50([r.ttft for r in quiet if r.ok])),
            "long_prompt_tokens": long.prompt_tokens if long_ok else None,
            "long_prompt_ttft_ms": _ms(long.ttft) if long_ok else None,
            "long_prompt_prefill_tok_s": round(long.prompt_tokens / long.ttft, 1) if long_ok and long.ttft else None,
            "tpot_at_long_context_ms": _ms(long.tpot) if long_ok else None,
        },
        "in_flight": {
            "requests": len(answers), "in_flight": plan.in_flight, "completed": len(done),
            "prompt_tokens_mean": round(statistics.fmean(r.prompt_tokens for r in done), 1) if done else None,
            "output_tok_s": round(sum(r.output_tokens for r in done) / chat_s, 2) if done else None,
            "ttft_p50_ms": ttfts["p50"], "ttft_p90_ms": ttfts["p90"],
        },
        "busy": {
            "neighbours": plan.neighbours, "tpot_p50_ms": _ms(busy_tpot),
            "over_quiet": round(busy_tpot / tpot, 2) if busy_tpot and tpot else None,
        },
        "output_tokens_as_asked": all(r.output_tokens == plan.max_tokens for r in [*quiet, *longs, *done, *busy]
                                      if r.ok),
        "failed_requests": len(failed),
        "sample_errors": [f"{r.status}: {r.error}" for r in failed][:3],
    }


# -- the servers ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One model as each server reads it: the GGUF file, and the Hugging Face folder of the same weights."""

    gguf: Path
    hf_folder: Path | None = None


def _argv(name: str, target: Target, plan: SizesPlan, port: int, threads: int | None,
          llama_server: Path | None, vllm_python: Path | None = None) -> list[str] | str:
    """The command that starts `name` on `target`, or a note saying why it is skipped."""
    if name == "chatloom":
        argv = [sys.executable, "-m", "chatloom.cli", "replica", "--model", str(target.gguf), "--port", str(port)]
        return argv + (["--threads", str(threads)] if threads else [])
    if name == "llama-server":
        if llama_server is None:
            return "no llama-server binary given (--llama-server)"
        if not (llama_server.is_file() and os.access(llama_server, os.X_OK)):
            return f"no llama-server binary at {llama_server}"
        argv = [str(llama_server), "-m", str(target.gguf), "--host", "127.0.0.1", "--port", str(port),
                "-c", str(plan.context_tokens()), "-np", str(plan.in_flight), "-kvu"]
        return argv + (["--threads", str(threads), "--threads-batch", str(threads)] if threads else [])
    if vllm_python is not None:
        if not (vllm_python.is_file() and os.access(vllm_python, os.X_OK)):
            return f"no Python at {vllm_python}"
    elif importlib.util.find_spec("vllm") is None:
        return "vLLM is not importable in this Python (give --vllm-python)"
    if target.hf_folder is None:
        return "no Hugging Face folder of the same weights given (--hf-folder)"
    argv = [str(vllm_python or sys.executable), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target.hf_folder),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", str(plan.sequence_tokens())]
    return argv


def load_rounds(target: Target, plan: SizesPlan, servers: tuple[str, ...], rounds: int,
                llama_server: Path | None = None, threads: int | None = None, log_dir: Path | None = None,
                vllm_python: Path | None = None) -> dict:
    """Only the load to ready, each server in turn for `rounds` rounds (load_time.py). JSON-ready."""
    from chatloom.bench.load_time import run_load_rounds

    commands, skipped = {}, {}
    for name in servers:
        argv = _argv(name, target, plan, 0, threads, llama_server, vllm_python)
        if isinstance(argv, str):
            skipped[name] = argv
        else:
            commands[name] = lambda port, name=name: (
                _argv(name, target, plan, port, threads, llama_server, vllm_python), _env(name, threads))
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    result = run_load_rounds(commands, rounds, plan.ready_timeout_s, IGNORE_EOS, log_dir)
    return {"benchmark": "sizes-load", "model": str(target.gguf), "file_bytes": target.gguf.stat().st_size,
            "cpus": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "skipped": skipped, **result}


def _env(name: str, threads: int | None) -> dict[str, str]:
    """What `name`'s environment adds to ours."""
    env: dict[str, str] = {}
    if name == "vllm":
        # vLLM's CPU backend reserves its KV cache up front (4 GiB by default): room for every in-flight
        # conversation at once, as llama-server gets with `-c`.
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "8")
        if threads:
            env.update(VLLM_CPU_OMP_THREADS_BIND="all", OMP_NUM_THREADS=str(threads))
    return env


def run_server(name: str, target: Target, plan: SizesPlan, texts: Texts, threads: int | None = None,
               llama_server: Path | None = None, log_dir: Path | None = None,
               vllm_python: Path | None = None) -> dict:
    """Start `name`, measure it, stop it: its figures, or {"skipped": why} / {"error": what went wrong}."""
    port = free_port()
    argv = _argv(name, target, plan, port, threads, llama_server, vllm_python)
    if isinstance(argv, str):
        return {"skipped": argv}
    env = _env(name, threads)
    log = log_dir / f"{target.gguf.stem}-{name}.log" if log_dir else None
    server = ServerProcess(name, argv, port, env, log)
    try:
        server.start()
        model = server.wait_ready(plan.ready_timeout_s, IGNORE_EOS)
        after_load = server.rss()
        figures = asyncio.run(_measure(server, model, plan, texts))
        return {"command": argv, "context_window": server.context_window,
                "load_to_ready_s": round(server.load_s or 0.0, 2),
                "rss_after_load_mib": round(after_load / 2**20, 1),
                "rss_peak_mib": round(server.high_water() / 2**20, 1), **figures}
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        return {"command": argv, "error": str(exc)}
    finally:
        server.stop()


def weight_bytes_per_step(gguf: Path) -> int:
    """Bytes of weights a decode step at batch 1 reads, as stored in the file: every tensor, except that
    the embedding table is read one row a token unless it is also the output head (tied)."""
    from chatloom.models.gguf_loader import open_gguf

    tensors = open_gguf(gguf).tensors
    names = {t.name for t in tensors}
    return sum(int(t.data.nbytes) for t in tensors
               if not (t.name == "token_embd.weight" and "output.weight" in names))


def run_sizes(targets: list[Target], plan: SizesPlan, servers: tuple[str, ...] = SERVERS,
              llama_server: Path | None = None, threads: int | None = None, log_dir: Path | None = None,
              seed: int = 0, vllm_python: Path | None = None) -> dict:
    """Every server on every target, one at a time. JSON-ready."""
    from chatloom.bench.roofline import read_bandwidth_gbps
    from chatloom.models.loader import load_tokenizer

    for t in targets:
        if not t.gguf.is_file():
            raise ValueError(f"no GGUF file at {t.gguf}")
        if t.hf_folder is not None and not (t.hf_folder / "config.json").is_file():
            raise ValueError(f"no Hugging Face folder (config.json) at {t.hf_folder}")
    unknown = [s for s in servers if s not in SERVERS]
    if unknown:
        raise ValueError(f"unknown server {unknown[0]!r}: use {', '.join(SERVERS)}")
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    bandwidth = read_bandwidth_gbps()
    models = []
    for target in targets:
        step_bytes = weight_bytes_per_step(target.gguf)
        roofline_s = step_bytes / (bandwidth * 1e9)
        entry: dict = {"model": str(target.gguf), "hf_folder": str(target.hf_folder) if target.hf_folder else None,
                       "file_bytes": target.gguf.stat().st_size, "weight_bytes_per_step": step_bytes,
                       "roofline_tpot_ms": float(f"{roofline_s * 1000:.4g}"), "servers": {}}
        tokenizer = load_tokenizer(str(target.gguf))
        for name in servers:
            # The same prompts for every server: the same seed, drawn afresh.
            figures = run_server(name, target, plan, Texts(tokenizer, seed), threads, llama_server, log_dir,
                                 vllm_python)
            tpot = (figures.get("one_in_flight") or {}).get("tpot_p50_ms")
            if tpot:
                figures["roofline_share"] = round(roofline_s * 1000 / tpot, 3)
            entry["servers"][name] = figures
        models.append(entry)
    return {"benchmark": "sizes", "plan": asdict(plan), "threads": threads, "cpus": os.cpu_count(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "read_bandwidth_gbps": bandwidth,
            "seed": seed, "models": models}


ROWS = [
    ("load to ready, s", lambda s: s.get("load_to_ready_s")),
    ("RSS after load, MiB", lambda s: s.get("rss_after_load_mib")),
    ("RSS peak, MiB", lambda s: s.get("rss_peak_mib")),
    ("1 in flight: TPOT p50, ms", lambda s: s["one_in_flight"]["tpot_p50_ms"]),
    ("1 in flight: TTFT short prompt, ms", lambda s: s["one_in_flight"]["short_prompt_ttft_p50_ms"]),
    ("1 in flight: TTFT long prompt, ms", lambda s: s["one_in_flight"]["long_prompt_ttft_ms"]),
    ("1 in flight: prefill, tok/s", lambda s: s["one_in_flight"]["long_prompt_prefill_tok_s"]),
    ("1 in flight: TPOT at long context, ms", lambda s: s["one_in_flight"]["tpot_at_long_context_ms"]),
    ("in flight: output tok/s", lambda s: s["in_flight"]["output_tok_s"]),
    ("in flight: TTFT p50, ms", lambda s: s["in_flight"]["ttft_p50_ms"]),
    ("in flight: TTFT p90, ms", lambda s: s["in_flight"]["ttft_p90_ms"]),
    ("busy neighbour: TPOT p50, ms", lambda s: s["busy"]["tpot_p50_ms"]),
    ("busy / quiet TPOT", lambda s: s["busy"]["over_quiet"]),
    ("roofline share", lambda s: s.get("roofline_share")),
]


def format_table(result: dict) -> str:
    """A Markdown table per model: one row per figure, one column per server."""
    out = []
    for m in result["models"]:
        names = list(m["servers"])
        out.append(f"{Path(m['model']).name}: {m['weight_bytes_per_step'] / 2**20:.0f} MiB of weights per step, "
                   f"roofline TPOT {m['roofline_tpot_ms']} ms at {result['read_bandwidth_gbps']} GB/s")
        out.append("| | " + " | ".join(names) + " |")
        out.append("|---|" + "---|" * len(names))
        for label, get in ROWS:
            cells = []
            for n in names:
                s = m["servers"][n]
                if "skipped" in s or "error" in s:
                    cells.append("skipped" if "skipped" in s else "error")
                    continue
                value = get(s)
                cells.append("-" if value is None else f"{value:,}" if isinstance(value, (int, float)) else str(value))
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        for n in names:
            s = m["servers"][n]
            if "skipped" in s or "error" in s:
                out.append(f"{n}: {s.get('skipped') or s.get('error')}")
        out.append("")
    return "\n".join(out)
