"""The checks at the end of a chaos run, each a pass or fail with the figures it was decided on.

They read the run's own PostgreSQL (what was stored and metered), the blob folder (what was
uploaded) and the Ledger (what the clients saw), after the traffic stopped and every answer ended.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from chatloom.bench.chaos.ledger import Ledger
from chatloom.bench.chaos.resources import Sampler, growth

RECOVERY_S = 10.0
GROWTH_LIMIT = 0.10
# Outside every fault's window, the share of requests that must get an HTTP reply (any status). A client
# that keeps a broken connection gets none for the rest of the run; the few a healthy run loses there
# are requests caught at a window's edge or by a client's own cut.
FLOWING_SHARE = 0.98
FINISHED = {"complete", "stopped", "incomplete", "interrupted"}  # incomplete: cut by max_tokens


@dataclass
class Check:
    name: str
    ok: bool
    figures: dict
    failures: list = field(default_factory=list)  # the first few cases that broke it

    def as_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "figures": self.figures, "failures": self.failures[:10]}


@dataclass
class Stored:
    """What the database holds at the end."""

    users: dict[str, dict]  # username -> {id, tier}
    messages: dict[str, dict]  # id -> row
    usage: dict[str, dict]  # user id -> summed row
    files: dict[str, dict]  # id -> row


async def read_store(url: str) -> Stored:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        users = {r["username"]: dict(r) for r in await conn.fetch("SELECT id, username, tier FROM users")}
        messages = {r["id"]: dict(r) for r in await conn.fetch(
            "SELECT m.id, m.conversation_id, m.role, m.text, m.tokens, m.status, m.finish_reason, m.prompt_tokens, "
            "m.completion_tokens, m.error, c.user_id FROM messages m JOIN conversations c ON c.id = m.conversation_id")}
        usage = {r["user_id"]: dict(r) for r in await conn.fetch(
            "SELECT user_id, sum(requests) AS requests, sum(prompt_tokens) AS prompt_tokens, "
            "sum(completion_tokens) AS completion_tokens, sum(cached_tokens) AS cached_tokens FROM usage "
            "GROUP BY user_id")}
        files = {r["id"]: dict(r) for r in await conn.fetch("SELECT id, blob_key, bytes FROM files")}
    finally:
        await conn.close()
    return Stored(users, messages, usage, files)


def acknowledged_messages_stored(ledger: Ledger, stored: Stored) -> Check:
    failures = []
    for a in ledger.answers:
        user_row = stored.messages.get(a.user_message_id)
        if user_row is None or user_row["role"] != "user" or user_row["text"] != a.text_sent:
            failures.append({"user_message_id": a.user_message_id, "found": user_row is not None})
        elif a.message_id not in stored.messages:
            failures.append({"message_id": a.message_id, "answer_row": False})
    return Check("acknowledged messages stored", not failures,
                 {"acknowledged": len(ledger.answers), "missing": len(failures)}, failures)


def answers_finished(stored: Stored, run_users: set[str]) -> Check:
    """Every answer is complete, stopped, cut by max_tokens or marked interrupted; none failed, none
    still running, none empty without saying why."""
    counts: dict[str, int] = {}
    failures = []
    for m in stored.messages.values():
        if m["role"] != "assistant" or m["user_id"] not in run_users:
            continue
        status = m["status"]
        counts[status] = counts.get(status, 0) + 1
        running = status == "incomplete" and m["finish_reason"] is None
        empty = not m["text"] and status != "interrupted" and m["finish_reason"] != "stop"
        if status not in FINISHED or running or empty:
            failures.append({"id": m["id"], "status": status, "finish_reason": m["finish_reason"],
                             "chars": len(m["text"] or ""), "error": m["error"]})
    return Check("answers complete or interrupted", not failures, {"by_status": counts, "bad": len(failures)},
                 failures)


def streams_exact(ledger: Ledger, stored: Stored) -> Check:
    """Followed answers: event ids 1..n with no gap or repeat, and the stored text is the streamed text."""
    followed = resumed = lost = end_lost = unfinished = 0
    failures = []
    for a in ledger.answers:
        if a.lost:
            lost += 1
            end_lost += a.end_lost
            continue
        if a.end is None:
            unfinished += 1
            failures.append({"message_id": a.message_id, "problem": "the client never saw the end"})
            continue
        followed += 1
        resumed += a.connections > 1
        ids = [i for i, _ in a.events]
        if ids != list(range(1, len(ids) + 1)):
            failures.append({"message_id": a.message_id, "problem": "ids not contiguous", "ids": ids[:40]})
            continue
        row = stored.messages.get(a.message_id)
        if a.end.get("event") == "done" and row is not None and row["text"] != a.streamed_text:
            failures.append({"message_id": a.message_id, "problem": "stored text differs",
                             "streamed": a.streamed_text[-80:], "stored": (row["text"] or "")[-80:]})
    return Check("resumed streams exact", not failures,
                 {"followed_to_end": followed, "resumed": resumed, "stream_gone_after_redis_wipe": lost,
                  "of_which_end_gone": end_lost, "unfinished": unfinished, "bad": len(failures)}, failures)


def quotas_kept(ledger: Ledger, stored: Stored, tiers: dict[str, int], discount: float = 0.5) -> Check:
    """No user's metered tokens (cached prompt tokens at the discount) above their tier's daily quota."""
    rows = []
    for name, tier in ledger.users.items():
        user = stored.users.get(name)
        used = stored.usage.get(user["id"]) if user else None
        if used is None:
            continue
        cost = int(used["prompt_tokens"]) + int(used["completion_tokens"]) - int(used["cached_tokens"]) * discount
        rows.append({"user": name, "tier": tier, "metered": round(cost, 1), "quota": tiers[tier]})
    failures = [r for r in rows if r["metered"] > r["quota"]]
    tight = [r for r in rows if r["tier"] == "tiny"]
    return Check("metered within quota", not failures,
                 {"users": len(rows), "over_quota_users": tight, "refused_429": sum(
                     1 for r in ledger.replies if r.status == 429)}, failures)


def metering_matches(ledger: Ledger, stored: Stored, chat_users: set[str]) -> Check:
    """Chat users: metered prompt tokens equal the sum over their stored answers; metered completion
    tokens equal the sum of the usage their answers' done events reported, where the client saw every
    answer end, and lie between that sum and it plus the unseen answers' max_tokens otherwise. (Stored
    answers keep their text's token count, a re-count that differs from the tokens generated.) A
    message whose POST broke where the client could not learn whether it was stored counts as an unseen
    answer of its max_tokens. OpenAI users (nothing stored): metered at least what the clients were told."""
    failures = []
    figures = {"chat_users": 0, "exact": 0, "bounded": 0, "openai_users": 0}
    by_id = {u["id"]: name for name, u in stored.users.items()}
    prompts: dict[str, int] = {}
    for m in stored.messages.values():
        if m["role"] == "assistant" and by_id.get(m["user_id"]) in chat_users:
            prompts[by_id[m["user_id"]]] = prompts.get(by_id[m["user_id"]], 0) + (m["prompt_tokens"] or 0)
    for name in sorted(chat_users):
        user = stored.users.get(name)
        used = stored.usage.get(user["id"]) if user else None
        prompt, completion = (int(used["prompt_tokens"]), int(used["completion_tokens"])) if used else (0, 0)
        mine = [a for a in ledger.answers if a.user == name]
        seen = sum(a.end["usage"]["completion_tokens"] for a in mine
                   if a.end and a.end.get("event") == "done" and a.end.get("usage"))
        unseen = [a.max_tokens for a in mine if not (a.end and a.end.get("event") == "done" and a.end.get("usage"))]
        unseen += [s.max_tokens for s in ledger.unknown_submissions if s.user == name]
        figures["chat_users"] += 1
        figures["exact" if not unseen else "bounded"] += 1
        ok = prompt == prompts.get(name, 0) and (
            completion == seen if not unseen else seen <= completion <= seen + sum(unseen))
        if not ok:
            failures.append({"user": name, "metered": [prompt, completion], "stored_prompt": prompts.get(name, 0),
                             "done_completion": seen, "answers_not_seen_ending": len(unseen),
                             **_where_metering_differs(mine, stored, user, used)})
    told: dict[str, list[int]] = {}
    for c in ledger.openai:
        t = told.setdefault(c.user, [0, 0])
        t[0] += c.prompt_tokens
        t[1] += c.completion_tokens
    for name, (p, c) in told.items():
        user = stored.users.get(name)
        used = stored.usage.get(user["id"]) if user else None
        metered = [int(used["prompt_tokens"]), int(used["completion_tokens"])] if used else [0, 0]
        figures["openai_users"] += 1
        if metered[0] < p or metered[1] < c:
            failures.append({"user": name, "metered": metered, "told_clients": [p, c]})
    return Check("metering equals stored answers", not failures, figures, failures)


def _where_metering_differs(mine: list, stored: Stored, user: dict | None, used: dict | None) -> dict:
    """For a user whose metering failed: whether the usage rows or the done events disagree with the
    answers as saved (each keeps the completion tokens its usage row was written with), and which answers'
    done events reported other counts than their saved rows."""
    saved = [m for m in stored.messages.values()
             if user is not None and m["user_id"] == user["id"] and m["role"] == "assistant"]
    by_id = {m["id"]: m for m in saved}
    differing = []
    for a in mine:
        if not (a.end and a.end.get("event") == "done" and a.end.get("usage")):
            continue
        row = by_id.get(a.message_id)
        said = a.end["usage"]["completion_tokens"]
        if row is None or row["completion_tokens"] != said:
            differing.append({"message_id": a.message_id, "done": said, "saved": row and row["completion_tokens"],
                              "status": row and row["status"], "connections": a.connections})
    followed = {a.message_id for a in mine}
    unfollowed = [m for m in saved if m["id"] not in followed]  # stored, but no client ever learned of it
    return {"saved_completion": sum(m["completion_tokens"] or 0 for m in saved),
            "saved_answers_no_client_followed": len(unfollowed),
            "their_completion": sum(m["completion_tokens"] or 0 for m in unfollowed),
            "saved_answers_with_usage": sum(1 for m in saved if m["completion_tokens"] is not None),
            "metered_requests": int(used["requests"]) if used else 0,
            "done_differs_from_saved": differing[:20], "done_differs_count": len(differing)}


def fault_windows(ledger: Ledger, grace_s: float = RECOVERY_S) -> list[tuple[float, float]]:
    """Each fault from its start to `grace_s` after every gateway was ready again."""
    return [(f.start, (f.ready or f.end or f.start) + grace_s) for f in ledger.faults]


def traffic_flowed(ledger: Ledger, share: float = FLOWING_SHARE) -> Check:
    """Outside every fault's window, at least `share` of the requests got an HTTP reply. Each try on a
    gateway is one request; a reply is any status, a request with none is a transport failure."""
    windows = fault_windows(ledger)
    outside = [r for r in ledger.replies if not any(a <= r.t <= b for a, b in windows)]
    answered = sum(1 for r in outside if r.status)
    got = answered / len(outside) if outside else 0.0
    failures = [{"t": round(r.t, 1), "gateway": r.gateway, "route": r.route} for r in outside if not r.status]
    return Check("traffic kept flowing", bool(outside) and got >= share,
                 {"requests": len(ledger.replies), "no_reply": sum(1 for r in ledger.replies if not r.status),
                  "outside_faults": len(outside), "answered_outside": round(got, 4), "required": share},
                 failures)


def no_unexpected_5xx(ledger: Ledger, grace_s: float = RECOVERY_S) -> Check:
    """Every 5xx is a 503 with Retry-After and an error code, inside a fault's window (start to
    ready + grace). Transport failures (a killed gateway's refused connections) are counted apart."""
    windows = fault_windows(ledger, grace_s)
    failures = []
    documented = 0
    for r in ledger.replies:
        if r.status < 500:
            continue
        in_fault = any(a <= r.t <= b for a, b in windows)
        if r.status == 503 and r.retry_after and r.code and (in_fault or r.code == "queue_full"):
            documented += 1
        else:  # which gateway, inside which faults' windows: where to look in the logs
            failures.append({"route": r.route, "status": r.status, "code": r.code, "retry_after": r.retry_after,
                             "in_fault_window": in_fault, "gateway": r.gateway,
                             "faults": [f"{f.kind} {f.target}" for f, (a, b) in zip(ledger.faults, windows)
                                        if a <= r.t <= b]})
    return Check("no 5xx but documented 503s", not failures,
                 {"replies": len(ledger.replies), "documented_503": documented, "other_5xx": len(failures),
                  "transport_errors": sum(1 for r in ledger.replies if r.status == 0)}, failures)


def recovered_in_time(ledger: Ledger) -> Check:
    rows, failures = [], []
    for f in ledger.faults:
        took = None if f.ready is None or f.end is None else round(max(0.0, f.ready - f.end), 2)
        rows.append({"kind": f.kind, "target": f.target, "recovery_s": took})
        if took is None or took > RECOVERY_S or f.note.startswith("injection failed"):
            failures.append({"kind": f.kind, "target": f.target, "recovery_s": took, "note": f.note})
    worst = max((r["recovery_s"] for r in rows if r["recovery_s"] is not None), default=None)
    return Check("ready within 10 s of each fault", not failures, {"faults": len(rows), "worst_s": worst},
                 failures)


def resources_flat(sampler: Sampler, t0: float, window_s: float) -> Check:
    """Each slot's resident memory and descriptors: last quarter's median within 10% of the first's."""
    rows = [growth(series, t0, window_s) for series in sampler.series.values()]
    judged = [r for r in rows if r["rss_growth"] is not None]
    failures = [r for r in judged if r["rss_growth"] >= GROWTH_LIMIT or r["fds_growth"] >= GROWTH_LIMIT]
    return Check("RSS and fds growth < 10%", bool(judged) and not failures,
                 {"judged": len(judged), "worst_rss_growth": max((r["rss_growth"] for r in judged), default=None),
                  "worst_fds_growth": max((r["fds_growth"] for r in judged), default=None),
                  "not_judged": [r["slot"] for r in rows if r["rss_growth"] is None], "slots": rows}, failures)


def uploads_kept(ledger: Ledger, stored: Stored, blobs: Path) -> Check:
    failures = []
    for u in ledger.uploads:
        row = stored.files.get(u.file_id)
        path = blobs / row["blob_key"] if row else None
        if row is None or row["bytes"] != u.size or path is None or not path.is_file() or path.stat().st_size != u.size:
            failures.append({"file_id": u.file_id, "row": row is not None})
    refused = sum(1 for r in ledger.replies if r.route == "files" and r.status >= 400)
    return Check("acknowledged uploads stored", not failures,
                 {"uploaded": len(ledger.uploads), "refused": refused, "missing": len(failures)}, failures)
