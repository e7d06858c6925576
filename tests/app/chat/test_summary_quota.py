"""Summaries are generations like any other: reserved against the quota and admitted through the
queue. Concurrent turns that trigger summaries never use more tokens than the per-minute limit."""
from __future__ import annotations

import asyncio

from chatloom.app.chat.prompt import SUMMARIZER_SYSTEM
from chatloom.store import Conversations, Messages

from app_testing import app_client, make_settings, new_conversation, parse_sse
from traffic_testing import ScriptedBackend, write_tiers

LIMIT = 1000


async def _long_history(app, cid: str, turns: int = 8) -> None:
    """A conversation whose history is far longer than the (small) context window."""
    async with app.state.ctx.db.session() as s:
        parent = None
        for i in range(turns):
            q = await Messages(s).add(cid, parent, "user", " ".join(f"q{i}w{j}" for j in range(15)), 15)
            a = await Messages(s).add(cid, q.id, "assistant", " ".join(f"a{i}w{j}" for j in range(15)), 15,
                                      "scripted")
            parent = a.id
        await Conversations(s).touch(cid, current_leaf_id=parent)
        await s.commit()


async def test_concurrent_turns_with_summaries_stay_within_the_minute_limit(tmp_path):
    backend = ScriptedBackend([" x"] * 60)
    tiers = write_tiers(tmp_path, free={"tokens_per_minute": LIMIT, "max_concurrent": 100,
                                        "requests_per_minute": 1000, "tokens_per_day": 100_000})
    settings = make_settings(tmp_path, traffic={"tiers_file": tiers}, moderation={"mode": "off"}, engine={"context_window": 160}, sampling={"max_tokens": 30}, chat={"summary_max_tokens": 40})
    async with app_client(settings, backend) as (client, app, alice):
        cids = [await new_conversation(client, alice) for _ in range(8)]
        for cid in cids:
            await _long_history(app, cid)

        async def turn(cid):
            r = await client.post(f"/conversations/{cid}/messages", headers=alice,
                                  json={"text": "and now a short question"})
            return r

        results = await asyncio.gather(*(turn(c) for c in cids))
        summaries = [r for r in backend.requests if r.messages[0]["content"] == SUMMARIZER_SYSTEM]
        assert summaries, "the long histories should have triggered summaries"
        used = 0
        for r in results:
            if r.status_code == 200:
                events = parse_sse(r.text)
                last = events[-1].data
                if last.get("done"):
                    used += last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
        # Everything the model did for alice in this minute (answers and summaries), as metered:
        usage = (await client.get("/usage", headers=alice)).json()
        total = usage["totals"]["total_tokens"]
        assert total >= used > 0
        assert total <= LIMIT, (total, len(summaries))
        assert usage["remaining_tokens_this_minute"] >= 0
