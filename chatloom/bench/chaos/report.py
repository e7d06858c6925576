"""The chaos run's result: one JSON document, and a table of the invariants and the faults."""
from __future__ import annotations

import re
from pathlib import Path

from chatloom.bench.chaos.invariants import RECOVERY_S, Check
from chatloom.bench.chaos.ledger import Ledger


def summary(checks: list[Check], ledger: Ledger, t0: float, meta: dict) -> dict:
    counts: dict[str, int] = {}
    for f in ledger.faults:
        counts[f.kind] = counts.get(f.kind, 0) + 1
    counts["client_cut"] = ledger.cuts
    return {
        **meta,
        "ok": all(c.ok for c in checks),
        "invariants": [c.as_dict() for c in checks],
        "fault_counts": counts,
        "faults": [{"kind": f.kind, "target": f.target, "at_s": round(f.start - t0, 1),
                    "lasted_s": round(f.end - f.start, 1) if f.end else None,
                    "ready_after_s": round(f.ready - f.end, 2) if f.ready and f.end else None,
                    "no_reply": _no_reply(ledger, f.start, (f.ready or f.end or f.start) + RECOVERY_S), "note": f.note}
                   for f in ledger.faults],
        "traffic": {"requests": len(ledger.replies), "replies": sum(1 for r in ledger.replies if r.status),
                    "no_reply": sum(1 for r in ledger.replies if not r.status),
                    "answers": len(ledger.answers), "refused_messages": ledger.refused_messages,
                    "answers_found_after_lost_reply": sum(1 for a in ledger.answers if a.found_after_lost_reply),
                    "unknown_submissions": len(ledger.unknown_submissions), "openai_calls": len(ledger.openai),
                    "uploads": len(ledger.uploads), "client_cuts": ledger.cuts,
                    "by_status": _by_status(ledger), "by_route": _by_route(ledger),
                    "no_reply_by_error": _no_reply_by_error(ledger)},
    }


# A log record starts with our format's timestamp or with uvicorn's level prefix; the lines up to the
# next start (a traceback) belong to it.
_RECORD_START = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d|[A-Z]+:\s)")
_ERROR_LEVEL = re.compile(r"^(\S+ \S+ )?(ERROR|CRITICAL)\b|^(ERROR|CRITICAL):")


def _clipped(record: list[str], lines: int) -> list[str]:
    """A record of at most `lines` lines: its head (the message, where the traceback starts) and its tail
    (the exception raised, which a traceback puts last), the middle's frames left out."""
    if len(record) <= lines:
        return record
    head = lines // 4
    tail = lines - head - 1
    return [*record[:head], f"    ... ({len(record) - head - tail} lines left out)", *record[-tail:]]


def logged_errors(folder: Path, per_log: int = 5, lines_each: int = 40) -> dict[str, list[str]]:
    """The processes' error records, the first few of each log, those with a traceback first: what
    explains a failed invariant once the run's folder is gone."""
    out: dict[str, list[str]] = {}
    for log in sorted(folder.glob("*.log")):
        records: list[list[str]] = []
        for line in log.read_text(errors="replace").splitlines():
            if _RECORD_START.match(line) or not records:
                records.append([line])
            else:
                records[-1].append(line)
        traced = [r for r in records if any(x.startswith("Traceback") for x in r[1:])]
        # Those with a traceback first: the expected errors of a fault (the database down) are many.
        errors = ["\n".join(_clipped(r, lines_each)) for r in traced + [r for r in records if _ERROR_LEVEL.match(r[0])
                                                                          and r not in traced]]
        if errors:
            out[log.stem] = errors[:per_log]
    return out


def _no_reply(ledger: Ledger, start: float, end: float) -> int:
    """Requests with no reply in a fault's window (from its start to RECOVERY_S after it is over)."""
    return sum(1 for r in ledger.replies if not r.status and start <= r.t <= end)


def _by_route(ledger: Ledger) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in ledger.replies:
        row = out.setdefault(r.route, {"requests": 0, "no_reply": 0})
        row["requests"] += 1
        row["no_reply"] += not r.status
    return dict(sorted(out.items()))


def _no_reply_by_error(ledger: Ledger) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in ledger.replies:
        if not r.status:
            out[r.error or "?"] = out.get(r.error or "?", 0) + 1
    return dict(sorted(out.items()))


def _by_status(ledger: Ledger) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in ledger.replies:
        key = str(r.status) if r.status else "transport"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def _short(figures: dict) -> str:
    parts = []
    for k, v in figures.items():
        if k == "slots":
            continue
        if k == "not_judged":
            v = ", ".join(v) or "none"
        elif k == "over_quota_users":
            v = ", ".join(f"{r['metered']:.0f}/{r['quota']}" for r in v)
        parts.append(f"{k}={v}")
    return "; ".join(parts)


def table(result: dict) -> str:
    lines = ["| invariant | result | figures |", "|---|---|---|"]
    for c in result["invariants"]:
        lines.append(f"| {c['name']} | {'pass' if c['ok'] else 'FAIL'} | {_short(c['figures'])} |")
    lines += ["", "| fault | target | at (s) | lasted (s) | ready after (s) | no reply | note |",
              "|---|---|---|---|---|---|---|"]
    for f in result["faults"]:
        lines.append(f"| {f['kind']} | {f['target']} | {f['at_s']} | {f['lasted_s']} | {f['ready_after_s']} | "
                     f"{f['no_reply']} | {f['note']} |")
    lines.append(f"| client_cut | streams | - | - | - | - | {result['fault_counts'].get('client_cut', 0)} cut and "
                 "resumed |")
    t = result["traffic"]
    lines += ["", f"requests {t['requests']}: {t['replies']} replied, {t['no_reply']} no reply; answers {t['answers']} "
              f"({t['answers_found_after_lost_reply']} found after a lost reply, {t['unknown_submissions']} "
              f"messages unknowable); client renewals {result.get('client_renewals', {})}"]
    for process, records in result.get("log_errors", {}).items():
        lines += ["", f"{process}.log, first errors:", *records]
    return "\n".join(lines)
