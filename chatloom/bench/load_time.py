"""`chatloom bench sizes --load-rounds N`: only the load, each server started and stopped in turn.

The time to ready is from the spawn to the first answered one-token chat request (server_process.py),
as in the full run; a round starts every server once, in the opposite order each round, so that a
minute of other work on a shared machine falls on all of them alike. Beside the wall time each start
reports the CPU seconds its process tree had used when it became ready (steadier than the wall time
when other programs take the cores) and its resident memory then.
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path

from chatloom.bench.server_process import ServerProcess, free_port, tree_pids


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds used by `pid` and the children it has now (vLLM's engine is one)."""
    total = 0.0
    for p in tree_pids(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue
    return total


def load_once(name: str, argv: list[str], timeout_s: float, extra: dict | None = None,
              log: Path | None = None, env: dict[str, str] | None = None) -> dict:
    """Start one server, wait until it answers, stop it: its load figures, or {"error": what went wrong}."""
    server = ServerProcess(name, argv, int(argv[argv.index("--port") + 1]), env or {}, log)
    try:
        server.start()
        server.wait_ready(timeout_s, extra)
        return {"load_to_ready_s": round(server.load_s or 0.0, 2),
                "cpu_s": round(_cpu_seconds(server.proc.pid), 2),
                "rss_after_load_mib": round(server.rss() / 2**20, 1)}
    except (RuntimeError, OSError) as exc:
        return {"error": str(exc)}
    finally:
        server.stop()


def run_load_rounds(commands: dict[str, "callable"], rounds: int, timeout_s: float,
                    extra: dict | None = None, log_dir: Path | None = None) -> dict:
    """`commands` maps a server's name to a function of a port giving its argv and the environment it
    adds. Returns every start's figures and each server's medians."""
    names = list(commands)
    starts: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            log = log_dir / f"{name}-load-{r}.log" if log_dir else None
            argv, env = commands[name](free_port())
            figures = load_once(name, argv, timeout_s, extra, log, env)
            figures["load_average"] = round(os.getloadavg()[0], 2)
            starts[name].append(figures)
    medians = {}
    for name, runs in starts.items():
        ok = [s for s in runs if "error" not in s]
        if ok:
            medians[name] = {key: round(statistics.median(s[key] for s in ok), 2)
                             for key in ("load_to_ready_s", "cpu_s", "rss_after_load_mib")}
    return {"rounds": rounds, "starts": starts, "medians": medians}


def format_load_table(result: dict) -> str:
    """A Markdown table: one row per round, one column per server, then the medians."""
    names = list(result["starts"])
    out = ["| round | " + " | ".join(f"{n}: s to ready (CPU s), load avg" for n in names) + " |",
           "|---|" + "---|" * len(names)]
    for r in range(result["rounds"]):
        cells = []
        for n in names:
            s = result["starts"][n][r]
            cells.append(s["error"][:40] if "error" in s else
                         f"{s['load_to_ready_s']} ({s['cpu_s']}), {s['load_average']}")
        out.append(f"| {r + 1} | " + " | ".join(cells) + " |")
    med = result["medians"]
    out.append("| median | " + " | ".join(
        f"{med[n]['load_to_ready_s']} ({med[n]['cpu_s']}), RSS {med[n]['rss_after_load_mib']} MiB" if n in med else "-"
        for n in names) + " |")
    return "\n".join(out)
