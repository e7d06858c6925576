"""Summaries are generations like any other: reserved against the user's quota and admitted
through the queue before they run.

A summary of older turns is model work done for the user who sent the new message. The answer's
reservation, made before any response was sent, holds an allowance for it (the run's
`summary_allowance`, an estimate from the stored token counts of the turns to fold); each summary
request takes its exact prompt plus its max_tokens from that allowance, so concurrent turns cannot
overshoot a limit together. A request the allowance cannot cover grows the reservation instead
(a run whose reservation had no room for the allowance, or one taken over from another gateway).
It then waits for a slot in the admission queue like an answer does. A summary that does not fit
(the quota would be exceeded, or the queue has no room in time) is skipped, never an error in the
answer's stream: the answer is then built from the newest turns that fit, the oldest dropped.
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
    if run.summary_allowance >= need:
        run.summary_allowance -= need
    elif run.reservation is not None:
        try:
            await traffic.extend(run.reservation, run.limits.tier, run.reservation.tokens + need)
        except ApiError as exc:
            log.info("summary skipped: %s", exc.message)
            yield False
            return
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
