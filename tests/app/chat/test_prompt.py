"""Prompt assembly as pure functions: what fits, what gets summarized, template overheads, titles."""
from __future__ import annotations

from chatloom.app.chat.conversation_service import make_title
from chatloom.app.chat.prompt import (TemplateCost, Turn, build_messages, chunk_turns, plan_prompt, summarizer_messages,
                                 system_content)

COST = TemplateCost(fixed=3, per_message=5)


def turns(*sizes: int) -> list[Turn]:
    return [Turn(f"m{i}", "user" if i % 2 == 0 else "assistant", "x" * n, n) for i, n in enumerate(sizes)]


def test_everything_fits():
    history = turns(10, 10, 10)
    plan = plan_prompt(history, budget=100, cost=COST, system_tokens=10, summary_tokens=0, summary_reserve=20)
    # 3 + 10 + 5 + 3 * (10 + 5) = 63 <= 100
    assert plan.kept == history and plan.to_summarize == [] and plan.use_summary


def test_existing_summary_counts_against_the_budget():
    history = turns(10, 10, 10)
    plan = plan_prompt(history, budget=100, cost=COST, system_tokens=10, summary_tokens=40, summary_reserve=20)
    assert plan.to_summarize  # 63 + 40 > 100


def test_overflow_keeps_the_newest_turns_from_a_user_turn_and_summarizes_the_rest():
    history = turns(30, 30, 30, 30, 30, 30, 30)
    plan = plan_prompt(history, budget=200, cost=COST, system_tokens=10, summary_tokens=0, summary_reserve=30,
                       keep_fraction=0.5)
    # room = 200 - (3 + 10 + 5) - 30 = 152; target 76: two turns of 35 fit, but the verbatim part starts at a user turn.
    assert [t.id for t in plan.kept] == ["m6"]
    assert [t.id for t in plan.to_summarize] == ["m0", "m1", "m2", "m3", "m4", "m5"]
    plan = plan_prompt(history, budget=200, cost=COST, system_tokens=10, summary_tokens=0, summary_reserve=30,
                       keep_fraction=0.8)
    assert [t.id for t in plan.kept] == ["m4", "m5", "m6"]
    assert plan.to_summarize == history[:4]


def test_a_new_message_too_big_for_a_summary_goes_alone():
    history = turns(10, 10, 150)
    plan = plan_prompt(history, budget=200, cost=COST, system_tokens=10, summary_tokens=0, summary_reserve=40)
    assert [t.id for t in plan.kept] == ["m2"] and not plan.use_summary and plan.to_summarize == []


def test_template_cost_measures_chatml():
    from chatloom.models.loader import _byte_tokenizer
    from chatloom.models.chat_template import render_chat

    tok = _byte_tokenizer()

    def count_prompt(messages):
        return len(tok.encode(render_chat(None, messages)))

    def count(text):
        return len(tok.encode(text, add_special=False))

    cost = TemplateCost.measure(count_prompt, count)
    # ChatML with a byte tokenizer: "<|im_start|>" + role + "\n" ... "<|im_end|>" + "\n".
    msgs = build_messages("sys", None, turns(7, 9, 11))
    assert cost.prompt(count("sys"), [7, 9, 11]) >= count_prompt(msgs) - 3
    assert abs(cost.prompt(count("sys"), [7, 9, 11]) - count_prompt(msgs)) <= 3


def test_messages_and_summary_prompt():
    assert system_content("Be nice.", None) == "Be nice."
    assert "Summary" in system_content("Be nice.", "They met in Paris.")
    msgs = summarizer_messages("Old summary.", turns(3, 4))
    assert "Old summary." in msgs[1]["content"] and "User: xxx\nAssistant: xxxx" in msgs[1]["content"]


def test_chunking_clips_oversized_turns():
    chunks = chunk_turns(turns(10, 10, 10, 500), budget=25)
    assert [[t.id for t in c] for c in chunks] == [["m0", "m1"], ["m2"], ["m3"]]
    assert chunks[-1][0].tokens == 25 and len(chunks[-1][0].text) < 500


def test_titles():
    assert make_title("Hello there") == "Hello there"
    assert make_title("  line one  \nline two") == "line one"
    long = make_title("word " * 40, 30)
    assert long.endswith("…") and len(long) <= 31 and not long[:-1].endswith(" ")
    assert make_title("x" * 100, 10) == "x" * 10 + "…"
