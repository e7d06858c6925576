"""One choice's pieces: logprob entries come out with the text they belong to, never ahead of the output
guard, and never for an answer the guard blocks."""
from __future__ import annotations

from chatloom.app.generation.choice_stream import ChoiceStream
from chatloom.app.generation.run_types import AnswerText, PromptLogprobs
from chatloom.app.traffic.moderation import LexiconModerator, NoModerator, OutputGuard
from chatloom.serving import Delta
from chatloom.serving.backend import TextLogprob


def _delta(text: str, finished: bool = False) -> Delta:
    return Delta(text, finished, "stop" if finished else None, logprobs=[TextLogprob(text, -0.5, list(text.encode()))])


async def _feed(stream: ChoiceStream, texts: list[str]) -> list:
    pieces = []
    for i, text in enumerate(texts):
        pieces += await stream.feed(_delta(text, finished=i == len(texts) - 1))
    return pieces


async def test_entries_travel_with_their_text():
    stream = ChoiceStream(OutputGuard(NoModerator()), None, None)
    first = await stream.feed(Delta("", prompt_logprobs=[TextLogprob("Hi", None)]))
    assert first == [PromptLogprobs((TextLogprob("Hi", None),))]
    pieces = await _feed(stream, ["Hello", " there", "!"])
    assert [(p.text, [e.token for e in p.logprobs]) for p in pieces] == \
        [("Hello", ["Hello"]), (" there", [" there"]), ("!", ["!"])]


async def test_entries_wait_for_the_guard_and_a_blocked_answer_shows_none():
    guard = OutputGuard(LexiconModerator({"violence": ["kill them all"]}), holdback_tokens=1)
    stream = ChoiceStream(guard, None, None)
    # " kill them" is let through once the next " kill" shows it is not the phrase; that " kill" is held,
    # and so is its entry, until " them all" completes the phrase and blocks the rest.
    pieces = await _feed(stream, ["We", " kill", " them", " kill", " them", " all", " now"])
    shown = "".join(p.text for p in pieces if isinstance(p, AnswerText))
    entries = [e.token for p in pieces if isinstance(p, AnswerText) for e in p.logprobs]
    assert guard.verdict is not None and shown == "We kill them"
    assert "".join(entries) == shown  # exactly the shown text's tokens: none of the blocked phrase
    assert stream.finish_reason(_delta("", finished=True)) == "content_filter"


async def test_held_entries_all_come_out_at_the_end():
    guard = OutputGuard(LexiconModerator({"violence": ["kill them all"]}), holdback_tokens=2)
    stream = ChoiceStream(guard, None, None)
    pieces = await _feed(stream, ["a", " b", " c", " d"])
    entries = [e.token for p in pieces if isinstance(p, AnswerText) for e in p.logprobs]
    assert entries == ["a", " b", " c", " d"]
    # an entry is never ahead of its text
    seen = ""
    for p in pieces:
        seen += p.text
        assert "".join(e.token for q in pieces[:pieces.index(p) + 1] for e in q.logprobs) == seen
