"""A chat answer's KV cache while its tools run: kept at the end of a round that may call tools, then held
for the resume or evicted (settings.tools.kv_policy; the engine's rule is in engine/kv_holds.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatloom.app.generation.pipeline import Run


def keeps_kv(run: Run) -> bool:
    """Whether the run's next round keeps its KV cache when it ends: it may call tools (under evict too, for
    the moment until tools_started says so, which counts the eviction)."""
    tools = run.ask.tools
    return tools is not None and tools.active and run.ask.n == 1


def kv_policy(run: Run) -> str:
    return run.pipeline.settings.tools.kv_policy


def tools_started(run: Run, tools: list[str]) -> None:
    """The round ended in calls to `tools`, which run now: hold its KV cache for the resume or evict it."""
    if run.keeps_kv:
        run.pipeline.backend.hold_kv(run.request_id, tools, kv_policy(run),
                                     run.pipeline.settings.tools.kv_hold_timeout_s)


def release_kv(run: Run) -> None:
    """No resume follows: free the KV cache the last round kept, if any."""
    if run.keeps_kv:
        run.keeps_kv = False
        run.pipeline.backend.release_kv(run.request_id)
