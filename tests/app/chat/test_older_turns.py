"""Long conversations: the older turns most relevant to a new message come back into its prompt, beside
the summary or instead of it (chat.older_turns), within chat.retrieved_turns_tokens."""
from __future__ import annotations

import pytest

from chatloom.app.chat.recall import RECALL_HEADER
from chatloom.app.chat.prompt import SUMMARY_HEADER

from app_testing import RecordingBackend, app_client, done_of, make_settings, new_conversation, send

WINDOW, MAX_TOKENS = 1024, 24
FACT = "Please remember this: the project's code name is Bluefin Kestrel."
QUESTION = "What was the project's code name that I asked you to remember?"


def settings_for(tmp_path, db_url, mode: str):
    return make_settings(tmp_path, server={"db_url": db_url}, engine={"context_window": WINDOW},
                         sampling={"max_tokens": MAX_TOKENS},
                         chat={"summary_max_tokens": 40, "older_turns": mode, "retrieved_turns_tokens": 300})


async def long_conversation(client, alice) -> str:
    """A conversation whose first turn states a fact, then outgrows the window on other topics."""
    cid = await new_conversation(client, alice)
    await send(client, alice, cid, FACT)
    for i in range(12):
        await send(client, alice, cid, f"Turn {i}: describe sunset number {i * 7} over the harbour in a few words.")
    return cid


@pytest.mark.parametrize("mode", ["both", "retrieved"])
async def test_an_old_turn_out_of_the_window_comes_back_when_asked_about(tmp_path, db_url, tiny_backend, mode):
    backend = RecordingBackend(tiny_backend)
    async with app_client(settings_for(tmp_path, db_url, mode), backend) as (client, app, alice):
        cid = await long_conversation(client, alice)
        _, events = await send(client, alice, cid, QUESTION)
        assert done_of(events)["usage"]["prompt_tokens"] <= WINDOW - MAX_TOKENS
        prompt = backend.answers()[-1].messages
        verbatim = [m["content"] for m in prompt[1:]]
        assert FACT not in verbatim and verbatim[-1] == QUESTION  # the fact's turn fell out of the window
        system = prompt[0]["content"]
        assert RECALL_HEADER + "User: " + FACT in system  # and came back, verbatim
        if mode == "both":
            assert backend.summaries() and SUMMARY_HEADER in system  # beside the summary
        else:
            assert backend.summaries() == [] and SUMMARY_HEADER not in system  # instead of it
        # A message about something else brings back nothing about it.
        await send(client, alice, cid, "Which colour are ripe lemons?")
        assert "Bluefin" not in backend.answers()[-1].messages[0]["content"]


async def test_summary_alone_brings_back_no_turn(tmp_path, db_url, tiny_backend):
    backend = RecordingBackend(tiny_backend)
    async with app_client(settings_for(tmp_path, db_url, "summary"), backend) as (client, app, alice):
        cid = await long_conversation(client, alice)
        await send(client, alice, cid, QUESTION)
        system = backend.answers()[-1].messages[0]["content"]
        assert RECALL_HEADER not in system and "Bluefin" not in system and backend.summaries()
