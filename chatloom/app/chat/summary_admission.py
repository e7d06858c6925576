"""Summaries are generations like any other: reserved against the user's quota and admitted
through the queue before they run.

A summary of older turns is model work done for the user who sent the new message. Before it
runs, the user's reservation grows by the summary's prompt plus its max_tokens (so concurrent turns
cannot overshoot the per-minute limit together), and it waits for a slot in the admission queue like
an answer does. A summary that does not fit (the quota would be exceeded, or the queue has no room
in time) is skipped: the answer is then built from the newest turns that fit, the oldest dropped.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from chatloom.app.traffic.admission import INTERACTIVE
from chatloom.app.core.errors import ApiError
from chatloom.serving import GenerationRequest

log = logging.getLogger(__name__)


@asynccontextmanager
async def admitted_summary(run: Any, request: GenerationRequest) -> AsyncIterator[bool]:
    """Yields True once the summary request is reserved and admitted, False when it must be skipped.
    `run` is the answer's pipeline Run (its user, tier and reservation); passed in, not imported."""
    traffic = run.traffic
    prompt = run.pipeline.backend.count_prompt_tokens(request.messages)
    need = prompt + request.max_tokens
    if run._reservation is not None:
        try:
            await traffic.extend(run._reservation, run.limits.tier, run._reservation.tokens + need)
        except ApiError as exc:
            log.info("summary skipped: %s", exc.message)
            yield False
            return
        run.summary_reserved += need  # the answer's own top-up comes on top of this
    try:
        slot = await traffic.admit(run.limits.tier, prompt, INTERACTIVE)
    except ApiError as exc:
        log.info("summary skipped: %s", exc.message)
        yield False
        return
    try:
        yield True
    finally:
        slot.release()
