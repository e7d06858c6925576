"""Speculative decoding on against off, in one run, greedy, at batch 1 and batch 8.

Three workloads: `repeating`, where the answer repeats the prompt (fix or rewrite a given
paragraph, an earlier turn written out again), which is where proposals are kept; `mixed`,
requests for a repeat that the small model answers its own way about half the time; and
`chat`, plain questions, where proposals mostly fail and the planner should switch
speculation off. Each row reports how much of the answer really repeats the prompt
(`repeat_fraction`). Both engines are built once and the rounds alternate which goes
first group by group, so a busy neighbour on a shared machine slows both alike. Prefix caching is off:
a repeated round must cost what the first did.
"""
from __future__ import annotations

import statistics
import time

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models.chat_template import encode_chat
from chatloom.models.loader import LoadedModel

PARAGRAPH = ("Teh quick brown fox jumpd over the lazy dog, and then it ran into the forrest to find "
             "it's friends. The friends was waiting near the old oak tree, where they shared berries "
             "and told storys until the sun went down.")
CODE = ("def average(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(value)\n\n\ndef largest(values):\n    best = values[0]\n"
        "    for v in values:\n        if v > best:\n            best = v\n    return best\n")
EMAIL = ("Hi team, the release is moved to Friday because the database migration needs one more "
         "day of testing. Please finish your reviews by Thursday noon and tell me if anything blocks you.")

STORY = ("Once upon a time there was a litle girl named Mia who lived in a small vilage by the sea. Every "
         "morning she walked to the harbor to watch the fishing boats come in, and she dreamed of sailing to far "
         "away lands.")
NOTICE = ("Dear residents, the water will be turned off on Tuesday from 9 am to 3 pm while the pipes in the "
          "basement are replaced. Please store some water in advance. We are sorry for the inconvenience.")
RECIPE = ("Mix two cups of flour with one cup of sugar. Add three eggs and half a cup of milk, then stir until "
          "smooth. Pour the batter into a pan and bake for thirty minutes at 180 degrees.")

FIX_SPELLING = "Fix the spelling and grammar in this paragraph and write it out again"
REPEAT_CORRECTED = "Repeat this paragraph, correcting only the mistakes"
EMAIL_TO_MONDAY = "Rewrite this email word for word, but replace Friday with Monday"
EMAIL_AS_LIST = "Format this email as a bulleted list, keeping every sentence as it is"


def _ask(instruction: str, text: str) -> list[dict]:
    """One user turn: an instruction, then the text it is about."""
    return [{"role": "user", "content": f"{instruction}:\n\n{text}"}]


# Requests whose answer repeats the prompt, as the bundled model answers them: its greedy answer to
# each is at least 90% tokens inside 3-grams of the prompt (`repeat_fraction` in the output reports
# this on every run). Fixing a text, rewriting it with one change, quoting an earlier turn.
REPEATING: list[list[dict]] = [
    _ask(FIX_SPELLING, PARAGRAPH),
    _ask(EMAIL_TO_MONDAY, EMAIL),
    [{"role": "user", "content": f"Here is a paragraph:\n\n{PARAGRAPH}"},
     {"role": "assistant", "content": "I have read it."},
     {"role": "user", "content": "Write the paragraph out again with the spelling fixed."}],
    _ask(FIX_SPELLING, STORY),
    _ask("Rewrite this notice word for word, but replace Tuesday with Thursday", NOTICE),
    _ask("Copy this recipe exactly, but change three eggs to two eggs", RECIPE),
    _ask(REPEAT_CORRECTED, STORY),
    _ask(EMAIL_AS_LIST, EMAIL),
]
# Requests that ask for a repeat which a 135M model often does not give: it rewrites the code
# its own way, or answers the quote request with a summary (repeat fractions of 0.0-0.5 on
# half of them). The first set the bench used; kept to show what speculation does when the
# proposals are only sometimes right.
MIXED: list[list[dict]] = [
    _ask(FIX_SPELLING, PARAGRAPH),
    _ask("There is a bug in this Python code. Fix it and print the whole corrected code", CODE),
    _ask(EMAIL_TO_MONDAY, EMAIL),
    _ask("Copy this code exactly, adding a docstring to each function", CODE),
    [{"role": "user", "content": f"Please remember this note: {EMAIL}"},
     {"role": "assistant", "content": "Noted. I will remember it."},
     {"role": "user", "content": "Quote my note back to me exactly, then say in one line what it asks."}],
    _ask(REPEAT_CORRECTED, PARAGRAPH),
    [{"role": "user", "content": f"Here is my code:\n{CODE}"},
     {"role": "assistant", "content": "Thanks, I see two functions, average and largest."},
     {"role": "user", "content": "Show the average function again, fixed, in a code block."}],
    _ask(EMAIL_AS_LIST, EMAIL),
]
CHAT: list[list[dict]] = [[{"role": "user", "content": q}] for q in (
    "Tell me a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue to a ten year old.",
    "Give me ideas for a weekend trip in the mountains.",
    "What is the difference between weather and climate?",
    "Write a short poem about autumn leaves.",
    "How do I start learning to play the guitar?",
    "Why do cats purr?",
)]
WORKLOADS = {"repeating": REPEATING, "mixed": MIXED, "chat": CHAT}


def _prompts(loaded: LoadedModel, convs: list[list[dict]]) -> list[list[int]]:
    return [encode_chat(loaded.tokenizer, messages) for messages in convs]


def _engine(loaded: LoadedModel, speculative: str, k: int, num_blocks: int, max_num_seqs: int,
            draft: str | None = None, adaptive: bool = True) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_blocks=num_blocks, max_num_seqs=max_num_seqs, enable_prefix_caching=False,
                                          speculative=speculative, num_speculative_tokens=k,
                                          speculative_model=draft, speculative_adaptive=adaptive))


def _timed_rounds(engines: dict[str, LLMEngine], prompts: list[list[int]], batch: int, max_tokens: int,
                  repeats: int) -> tuple[dict[str, list[float]], dict[str, list[list[int]]], dict[str, float]]:
    """Prompts in groups of `batch`, each group run to completion by every engine in turn
    (the order alternating group by group), so a noisy neighbour's bursts land on every
    mode alike. Seconds per mode and round, each mode's outputs, and each mode's TPOT in ms
    (all rounds' requests: time from first to last token over tokens after the first)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    seconds = {m: [0.0] * repeats for m in engines}
    outputs: dict[str, list[list[int]]] = {m: [] for m in engines}
    streaming = {m: [0.0, 0] for m in engines}  # seconds after the first token, tokens after the first
    turn = 0
    for r in range(repeats):
        for i in range(0, len(prompts), batch):
            order = list(engines) if turn % 2 == 0 else list(reversed(engines))
            turn += 1
            for mode in order:
                t0 = time.perf_counter()
                outs = engines[mode].generate(prompts[i:i + batch], params, use_tqdm=False)
                seconds[mode][r] += time.perf_counter() - t0
                for o in outs:
                    if o.num_output_tokens > 1:
                        streaming[mode][0] += o.metrics.last_token_time - o.metrics.first_token_time
                        streaming[mode][1] += o.num_output_tokens - 1
                if r == 0:
                    outputs[mode] += [o.token_ids for o in outs]
    tpot = {m: round(1e3 * t / n, 3) if n else None for m, (t, n) in streaming.items()}
    return seconds, outputs, tpot


def repeat_fraction(prompts: list[list[int]], answers: list[list[int]], n: int = 3) -> float:
    """Share of answer tokens inside an n-gram that also occurs in the answer's prompt: how
    much of what the model wrote it copied."""
    copied = total = 0
    for prompt, answer in zip(prompts, answers):
        grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
        inside: set[int] = set()
        for i in range(len(answer) - n + 1):
            if tuple(answer[i:i + n]) in grams:
                inside.update(range(i, i + n))
        copied += len(inside)
        total += len(answer)
    return round(copied / total, 3) if total else 0.0


def _spec_summary(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in after if k != "spec_decode_acceptance_rate"}
    drafted, drafts = d["spec_decode_num_draft_tokens"], d["spec_decode_num_drafts"]
    return {"acceptance_rate": round(d["spec_decode_num_accepted_tokens"] / drafted, 3) if drafted else None,
            "mean_accepted_per_draft": round(d["spec_decode_num_accepted_tokens"] / drafts, 2) if drafts else None,
            "draft_tokens": drafted, "spec_steps": d["spec_decode_spec_steps"],
            "plain_steps": d["spec_decode_plain_steps"]}


def run_spec(loaded: LoadedModel, batch_sizes: tuple[int, ...] = (1, 8), max_tokens: int = 128,
             num_prompts: int = 8, repeats: int = 1, k: int = 4, draft: str | None = None,
             adaptive: bool = True) -> dict:
    """`draft`: also run the draft-model proposer with this --speculative-model."""
    num_blocks = (max(batch_sizes) + 1) * (-(-(1024 + max_tokens + k) // 16))
    engines = {"off": _engine(loaded, "off", k, num_blocks, max(batch_sizes)),
               "ngram": _engine(loaded, "ngram", k, num_blocks, max(batch_sizes), adaptive=adaptive)}
    if draft:
        engines["draft"] = _engine(loaded, "draft", k, num_blocks, max(batch_sizes), draft, adaptive)
    spec_modes = [m for m in engines if m != "off"]
    results = []
    for name, convs in WORKLOADS.items():
        prompts = _prompts(loaded, convs[:num_prompts])
        for batch in batch_sizes:
            before = {m: engines[m].spec.stats.as_dict() for m in spec_modes}
            seconds, outs, tpot = _timed_rounds(engines, prompts, batch, max_tokens, repeats)
            tokens = {m: sum(len(x) for x in o) for m, o in outs.items()}
            rate = {m: tokens[m] / statistics.median(seconds[m]) for m in seconds}
            row = {"workload": name, "batch": batch, "prompts": len(prompts), "output_tokens": tokens,
                   "repeat_fraction": repeat_fraction(prompts, outs["off"]),
                   "seconds": {m: [round(x, 3) for x in v] for m, v in seconds.items()},
                   "output_tokens_per_s": {m: round(v, 2) for m, v in rate.items()},
                   "speedup": round(rate["ngram"] / rate["off"], 3),
                   # The streaming pace a reader sees, without the prefill both modes share.
                   "tpot_ms": tpot,
                   "tpot_speedup": round(tpot["off"] / tpot["ngram"], 3) if tpot["off"] and tpot["ngram"] else None,
                   **_spec_summary(before["ngram"], engines["ngram"].spec.stats.as_dict()),
                   "identical_outputs": sum(a == b for a, b in zip(outs["off"], outs["ngram"]))}
            if draft:
                row["draft"] = {"speedup": round(rate["draft"] / rate["off"], 3),
                                **_spec_summary(before["draft"], engines["draft"].spec.stats.as_dict()),
                                "identical_outputs": sum(a == b for a, b in zip(outs["off"], outs["draft"]))}
            results.append(row)
    speed = {(r["workload"], r["batch"]): r["speedup"] for r in results}
    targets = {}
    if ("repeating", 1) in speed:
        targets["repeating_batch1_at_least_1.5x"] = speed[("repeating", 1)] >= 1.5
    targets["never_below_0.95x_elsewhere"] = all(v >= 0.95 for key, v in speed.items() if key != ("repeating", 1))
    return {"benchmark": "spec", "model": loaded.id, "max_tokens": max_tokens, "num_speculative_tokens": k,
            "repeats": repeats, "adaptive": adaptive, "speculative_model": draft, "results": results,
            "targets_met": targets}
