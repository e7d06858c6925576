"""Multi-turn chat with a shared system prompt: each turn resends the whole history.
TTFT per turn with the prefix cache on and off, in one run."""
from __future__ import annotations

import time

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models.chat_template import encode_chat
from chatloom.models.loader import LoadedModel

SYSTEM_PROMPT = (
    "You are chatloom's assistant. Answer briefly and precisely. "
    "Follow these house rules: be polite; cite units with every number; prefer short lists; "
    "when unsure, say so; never invent facts; keep code in fenced blocks; explain acronyms on first use; "
    "answer in the language of the question; avoid jargon unless asked; summarize long answers at the end. "
) * 3

QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?", "Name a primary colour.",
    "What is two plus two?", "Which planet is known as the red planet?", "What is water made of?",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water at sea level?",
    "How many days are in a leap year?", "What gas do plants take in?", "What is the largest ocean?",
    "How many continents are there?",
]


def _ttft(engine: LLMEngine, prompt_ids: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    t0 = time.perf_counter()
    engine.add_request(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0))
    first, final = None, None
    while final is None:
        for out in engine.step():
            if first is None and out.delta_token_ids:
                first = time.perf_counter() - t0
            if out.finished:
                final = out
    if first is None:
        first = time.perf_counter() - t0
    return first, final.token_ids, final.num_cached_tokens


def run_prefix(loaded: LoadedModel, turns: int = 8, max_tokens: int = 32, conversations: int = 2) -> dict:
    tok = loaded.tokenizer
    results = {}
    for enabled in (True, False):
        engine = LLMEngine(loaded, EngineConfig(enable_prefix_caching=enabled, kv_cache_gb=1.0))
        per_turn = [[] for _ in range(turns)]
        prompt_lens = []
        for c in range(conversations):
            history = [{"role": "system", "content": SYSTEM_PROMPT}]
            for t in range(turns):
                history.append({"role": "user", "content": QUESTIONS[(c * 3 + t) % len(QUESTIONS)]})
                ids = encode_chat(tok, history)
                ttft, out_ids, _ = _ttft(engine, ids, max_tokens)
                per_turn[t].append(ttft)
                if c == 0:
                    prompt_lens.append(len(ids))
                history.append({"role": "assistant", "content": tok.decode(out_ids)})
        key = "cache_on" if enabled else "cache_off"
        results[key] = {
            "ttft_ms_per_turn": [round(1000 * sum(v) / len(v), 2) for v in per_turn],
            "hit_rate": round(engine.kv_cache_manager.hit_rate, 4),
        }
        results["prompt_tokens_per_turn"] = prompt_lens
    on, off = results["cache_on"]["ttft_ms_per_turn"], results["cache_off"]["ttft_ms_per_turn"]
    results["benchmark"] = "prefix"
    results["turns"] = turns
    results["last_turn_speedup"] = round(off[-1] / on[-1], 2)
    return results
