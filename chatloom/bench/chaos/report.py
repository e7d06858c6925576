"""The chaos run's result: one JSON document, and a table of the invariants and the faults."""
from __future__ import annotations

from chatloom.bench.chaos.invariants import Check
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
                    "ready_after_s": round(f.ready - f.end, 2) if f.ready and f.end else None, "note": f.note}
                   for f in ledger.faults],
        "traffic": {"replies": len(ledger.replies), "answers": len(ledger.answers),
                    "refused_messages": ledger.refused_messages, "openai_calls": len(ledger.openai),
                    "uploads": len(ledger.uploads), "client_cuts": ledger.cuts,
                    "by_status": _by_status(ledger)},
    }


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
    lines += ["", "| fault | target | at (s) | lasted (s) | ready after (s) | note |", "|---|---|---|---|---|---|"]
    for f in result["faults"]:
        lines.append(f"| {f['kind']} | {f['target']} | {f['at_s']} | {f['lasted_s']} | {f['ready_after_s']} | "
                     f"{f['note']} |")
    lines.append(f"| client_cut | streams | - | - | - | {result['fault_counts'].get('client_cut', 0)} cut and resumed |")
    return "\n".join(lines)
