"""A gateway killed after saving an answer cut by max_tokens (status 'incomplete', finish_reason
'length') but before letting its job go: the gateway that takes the job over must leave the saved
answer as it is. Before, 'incomplete' alone was read as "still being written" and the finished answer
was overwritten as failed ("its gateway stopped and the answer could not be continued")."""
from __future__ import annotations

from chatloom.app.state.jobs import JobRecord
from chatloom.store import Message

from app_testing import new_conversation, parse_sse


async def test_a_taken_over_job_whose_answer_ended_by_length_is_left_alone(app, client, alice):
    cid = await new_conversation(client, alice)
    r = await client.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hello", "max_tokens": 1})
    done = parse_sse(r.text)[-1].data
    assert done["finish_reason"] == "length" and done["status"] == "incomplete", done
    ctx = app.state.ctx
    record = JobRecord(cid, "a-dead-gateway", message_id=done["message_id"], spec={})
    await ctx.hot.fail_job(record, "its gateway stopped and the answer could not be continued", ctx.db)
    async with ctx.db.session() as session:
        saved = await session.get(Message, done["message_id"])
    assert (saved.status, saved.finish_reason, saved.error) == ("incomplete", "length", None)
