"""Helpers for the traffic-control tests: a backend that streams scripted text (so a test can make the
"model" say exactly what it needs, at a chosen pace) and a tiers file.

(A uniquely named module, like app_testing, so test modules import it directly.)"""
from __future__ import annotations

import asyncio
from pathlib import Path

from chatloom.serving import Backend, BackendStats, Delta, GenerationRequest, Timings


class ScriptedBackend(Backend):
    """Answers every request with the same pieces of text, one per `delay_s`.
    A token is a whitespace-separated word; each message costs its words + 3. `cached` prompt tokens
    (at most the whole prompt) are reported as found in the prefix cache."""

    def __init__(self, pieces: list[str] | None = None, delay_s: float = 0.0, room: bool = True,
                 cached: int = 0) -> None:
        self.pieces = pieces if pieces is not None else ["Hello", " there", ",", " friend", "."]
        self.cached = cached
        self.delay_s = delay_s
        self.room = room
        self.requests: list[GenerationRequest] = []
        self.aborted: set[str] = set()
        self.running = 0
        self.max_running = 0

    ready = True
    model_ids = ["scripted"]
    context_window = 4096

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def count_prompt_tokens(self, messages: list[dict]) -> int:
        return sum(len((m.get("content") or "").split()) + 3 for m in messages)

    def has_room(self, prompt_tokens: int) -> bool:
        return self.room

    def stats(self) -> BackendStats:
        return BackendStats(ready=True, num_requests_running=self.running, num_requests_waiting=0,
                            kv_cache_usage_perc=0.25, prefix_cache_queries=100, prefix_cache_hits=40,
                            num_preemptions=0, generation_tokens_per_s=12.5)

    async def stream(self, request: GenerationRequest):
        self.requests.append(request)
        prompt = self.count_prompt_tokens(request.messages or [])
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            sent = 0
            for piece in self.pieces[: request.max_tokens]:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if request.request_id in self.aborted:
                    yield Delta("", True, "abort", prompt, sent)
                    return
                sent += 1
                yield Delta(piece, False, None, prompt, sent)
            reason = "length" if len(self.pieces) > request.max_tokens else "stop"
            yield Delta("", True, reason, prompt, sent, min(self.cached, prompt),
                        Timings(queue_time=0.001, ttft=0.01, tpot=0.002, e2e=0.02))
        finally:
            self.running -= 1

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)


def write_tiers(path: Path, **tiers: dict) -> str:
    """A TOML tiers file: write_tiers(p, free={"tokens_per_minute": 100}, pro={...})."""
    lines = []
    for name, fields in tiers.items():
        lines.append(f"[{name}]")
        for k, v in fields.items():
            lines.append(f"{k} = {v!r}" if not isinstance(v, list) else f"{k} = {v!r}".replace("'", '"'))
    file = path / "tiers.toml"
    file.write_text("\n".join(lines) + "\n")
    return str(file)
