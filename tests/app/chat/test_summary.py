"""Prompt assembly past the context window: older turns are summarized once, stored, and reused."""
from __future__ import annotations

from chatloom.app.chat.prompt import SUMMARY_HEADER
from chatloom.serving import BackendError

from app_testing import RecordingBackend, app_client, done_of, make_settings, new_conversation, parse_sse, send


async def test_history_past_the_window_is_summarized_once_and_reused(tmp_path, tiny_backend):
    window, max_tokens = 1024, 24
    settings = make_settings(tmp_path, engine={"context_window": window}, sampling={"max_tokens": max_tokens}, chat={"summary_max_tokens": 40})
    backend = RecordingBackend(tiny_backend)
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        states = []
        for i in range(turns := 14):
            _, events = await send(client, alice, cid, f"Turn {i}: tell me about the number {i * 7} in a few words.")
            # Every prompt fits the window with room for the answer.
            assert done_of(events)["usage"]["prompt_tokens"] <= window - max_tokens
            conv = (await client.get(f"/conversations/{cid}", headers=alice)).json()
            states.append((conv["summary"], conv["summary_upto"]))

        summaries = backend.summaries()
        assert summaries, "the history outgrew the window but was never summarized"
        assert len(summaries) <= turns // 4, "the summary should be reused for several turns, not rebuilt each time"
        # Once a summary exists, it goes into the system message of the answers that follow.
        first_with_summary = next(i for i, (s, _) in enumerate(states) if s)
        later_prompts = backend.answers()[first_with_summary:]
        for i, req in enumerate(later_prompts):
            summary, _ = states[first_with_summary + i]
            assert req.messages[0]["content"].endswith(SUMMARY_HEADER + summary) or i == 0
        # Reuse: some consecutive turns kept the very same summary.
        assert any(a == b and a[0] for a, b in zip(states, states[1:]))

        # summary_upto is a message on the branch, and the turns after it are sent verbatim.
        conv = (await client.get(f"/conversations/{cid}", headers=alice)).json()
        ids = [m["id"] for m in conv["messages"]]
        upto = conv["summary_upto"]
        assert upto in ids
        last_prompt = backend.answers()[-1].messages
        verbatim = [m["content"] for m in last_prompt[1:]]
        after = [m["text"] for m in conv["messages"][ids.index(upto) + 1:-1]]
        assert verbatim == after[-len(verbatim):]
        assert verbatim[-1] == conv["messages"][-2]["text"]  # the newest user message
        assert verbatim[0] not in [m["text"] for m in conv["messages"][: ids.index(upto) + 1]]


async def test_short_conversations_are_not_summarized(tmp_path, tiny_backend):
    backend = RecordingBackend(tiny_backend)
    async with app_client(make_settings(tmp_path), backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        for i in range(3):
            await send(client, alice, cid, f"message {i}")
        assert backend.summaries() == []
        last = backend.answers()[-1].messages
        assert [m["role"] for m in last] == ["system"] + ["user", "assistant"] * 2 + ["user"]
        assert last[0]["content"] == "Be brief."


class FailingBackend(RecordingBackend):
    """Streams two deltas from the real backend, then fails like a crashed engine."""

    async def stream(self, request):
        n = 0
        async for delta in self.inner.stream(request):
            yield delta
            n += 1
            if n == 2:
                raise BackendError("the engine loop died")


async def test_a_failure_after_the_stream_started_is_an_error_event(tmp_path, tiny_backend):
    async with app_client(make_settings(tmp_path), FailingBackend(tiny_backend)) as (client, app, alice):
        cid = await new_conversation(client, alice)
        r = await client.post(f"/conversations/{cid}/messages", headers=alice, json={"text": "hi", "max_tokens": 50})
        assert r.status_code == 200
        events = parse_sse(r.text)
        assert [e.event for e in events] == [None] * (len(events) - 1) + ["error"]
        assert all(e.id for e in events)
        error = events[-1].data
        assert "the engine loop died" in error["error"]["message"] and error["message_id"] == r.headers["x-message-id"]
        answer = (await client.get(f"/conversations/{cid}", headers=alice)).json()["messages"][-1]
        assert answer["status"] == "error" and "the engine loop died" in answer["error"]
        assert answer["text"] == "".join(e.data["token"] for e in events[:-1])
        # The conversation is usable again afterwards.
        assert app.state.ctx.conversations.running(cid) is None
